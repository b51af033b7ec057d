"""The dispatch core stays pure (no I/O, clock, threads or hidden randomness in its modules),
and the shell reaches the instances only through `gateway/upstream/`: no gateway module
imports aiohttp's client, and only the upstream pool opens a connection.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import gateway
import gateway.dispatch

DISPATCH_DIR = Path(gateway.dispatch.__file__).parent
GATEWAY_DIR = Path(gateway.__file__).parent
SEAM = GATEWAY_DIR / "upstream"

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
        "least_time.py",
        "strategies.py",
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


# ------------------------------------------------------------------ the network seam

# What a gateway module may take from aiohttp: the server side and the version string.
# A bare `import aiohttp` would reach `aiohttp.ClientSession` and friends.
SERVER_MODULES = ("aiohttp.web", "aiohttp.typedefs", "aiohttp.abc")
SERVER_NAMES = frozenset({"web", "typedefs", "abc", "__version__"})


def client_imports(source: str, filename: str = "<source>") -> list[str]:
    """Return one message per import that could reach aiohttp's client in `source`."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                name = alias.name
                if name.split(".")[0] == "aiohttp" and not name.startswith(SERVER_MODULES):
                    found.append(f"{filename}:{node.lineno}: import {name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            module = node.module
            if module == "aiohttp":
                names = [a.name for a in node.names if a.name not in SERVER_NAMES]
                if names:
                    found.append(f"{filename}:{node.lineno}: from aiohttp import {names}")
            elif module.split(".")[0] == "aiohttp" and not module.startswith(SERVER_MODULES):
                found.append(f"{filename}:{node.lineno}: from {module} import ...")
    return found


def shell_modules() -> list[Path]:
    return sorted(GATEWAY_DIR.rglob("*.py"))


def test_seam_checker_sees_the_shell() -> None:
    """The checker walks the real shell modules that once read aiohttp's responses."""
    names = {p.name for p in shell_modules()}
    assert {"handler.py", "relay.py", "probes.py", "peer_metrics.py", "client.py"} <= names


@pytest.mark.parametrize("path", shell_modules(), ids=lambda p: str(p.relative_to(GATEWAY_DIR)))
def test_no_module_imports_aiohttp_client(path: Path) -> None:
    """Every call to an instance goes through our own client: none imports aiohttp's."""
    assert client_imports(path.read_text(encoding="utf-8"), str(path)) == []


def test_only_the_upstream_package_opens_connections() -> None:
    """Sockets to instances are opened in gateway/upstream/ alone (the simulator aside)."""
    openers = {
        p.relative_to(GATEWAY_DIR).as_posix()
        for p in shell_modules()
        if "create_connection(" in p.read_text(encoding="utf-8")
        or "open_connection(" in p.read_text(encoding="utf-8")
    }
    assert openers == {"upstream/pool.py"}


@pytest.mark.parametrize(
    "source",
    [
        "import aiohttp",
        "import aiohttp as http",
        "import aiohttp.client",
        "from aiohttp import ClientSession",
        "from aiohttp import web, ClientError",
        "from aiohttp.client_exceptions import ClientError",
        "from aiohttp.connector import TCPConnector",
    ],
)
def test_seam_checker_flags_client_imports(source: str) -> None:
    """Every way of importing aiohttp's client is caught."""
    assert client_imports(source) != [], source


def test_seam_checker_allows_the_server_side() -> None:
    """The server side, its types and the version string are not the client."""
    source = (
        "from aiohttp import web\n"
        "from aiohttp.typedefs import Middleware\n"
        "from aiohttp import __version__ as v\n"
        "import aiohttp.web\n"
        "from .upstream import Upstream\n"
    )
    assert client_imports(source) == []
