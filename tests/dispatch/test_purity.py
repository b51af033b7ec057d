"""The dispatch core stays pure: no I/O, clock, threads or hidden randomness in its modules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import gateway.dispatch

DISPATCH_DIR = Path(gateway.dispatch.__file__).parent

# Top-level module names the core may not import (I/O, clocks, loops, threads, logging, metrics).
FORBIDDEN = frozenset(
    {
        "asyncio",
        "aiohttp",
        "time",
        "structlog",
        "prometheus_client",
        "datetime",
        "socket",
        "threading",
        "os",
    }
)


def impurities(source: str, filename: str = "<source>") -> list[str]:
    """Return one message per forbidden import or `random.<function>(...)` call in `source`.

    `import random` is allowed, because the core names `random.Random` in its type hints,
    but calling anything on the module (`random.random()`, `random.Random()`, ...) is not:
    the shell owns the generator and passes it in.
    """
    tree = ast.parse(source, filename)
    found: list[str] = []
    random_aliases: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                if top in FORBIDDEN:
                    found.append(f"{filename}:{node.lineno}: import {alias.name}")
                elif top == "random":
                    random_aliases.add(alias.asname or "random")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            top = node.module.split(".")[0]
            if top in FORBIDDEN:
                found.append(f"{filename}:{node.lineno}: from {node.module} import ...")
            elif top == "random":
                names = [a.name for a in node.names if a.name != "Random"]
                if names:
                    found.append(f"{filename}:{node.lineno}: from random import {names}")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id in random_aliases
        ):
            found.append(f"{filename}:{node.lineno}: call random.{node.func.attr}()")
    return found


def dispatch_modules() -> list[Path]:
    return sorted(DISPATCH_DIR.glob("*.py"))


def test_checker_sees_every_dispatch_module() -> None:
    """The checker walks the real core modules, so an empty glob cannot pass vacuously."""
    names = {p.name for p in dispatch_modules()}
    assert {
        "__init__.py",
        "model.py",
        "select.py",
        "scheduler.py",
        "health.py",
        "retry.py",
    } <= names


@pytest.mark.parametrize("path", dispatch_modules(), ids=lambda p: p.name)
def test_dispatch_module_is_pure(path: Path) -> None:
    """No dispatch module imports I/O, clock, loop, thread, logging or metrics modules."""
    assert impurities(path.read_text(encoding="utf-8"), str(path)) == []


@pytest.mark.parametrize("module", sorted(FORBIDDEN))
@pytest.mark.parametrize(
    "template",
    ["import {m}", "import {m} as alias", "from {m} import something", "import {m}.sub"],
)
def test_checker_flags_forbidden_import(module: str, template: str) -> None:
    """Every forbidden module is caught however it is imported."""
    source = template.format(m=module)
    assert impurities(source) != [], source


def test_checker_flags_asyncio_in_a_module_like_source() -> None:
    """Adding `import asyncio` to otherwise clean core code makes the check fail."""
    clean = "from __future__ import annotations\n\nimport random\n\nfrom .model import Ticket\n"
    assert impurities(clean) == []
    dirty = clean + "import asyncio\n"
    assert impurities(dirty) == ["<source>:6: import asyncio"]


def test_checker_allows_random_only_as_a_type() -> None:
    """`random.Random` in annotations passes; any call on the `random` module does not."""
    typed = (
        "import random\n"
        "def choose(xs: list[int], rng: random.Random) -> int:\n"
        "    return rng.choice(xs)\n"
    )
    assert impurities(typed) == []
    assert impurities("import random\nx = random.random()\n") == [
        "<source>:2: call random.random()"
    ]
    assert impurities("import random\nrng = random.Random(0)\n") != []
    assert impurities("import random as r\nr.shuffle([1])\n") != []
    assert impurities("from random import choice\n") != []
    assert impurities("from random import Random\n") == []


def test_checker_ignores_relative_and_unrelated_imports() -> None:
    """Relative imports and allowed stdlib modules are not mistaken for forbidden ones."""
    source = "from . import health\nfrom .time import x\nimport enum\nimport timeit\n"
    assert impurities(source) == []
