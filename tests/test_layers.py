"""The house keeps its shape: packages import only downward, and no import runs in a circle.

Layers, low to high (README, Layout): the shared vocabulary (`errors`, `routes`,
`lifecycle`), `dispatch` (the pure core), `config`, `upstream`, `observe`, `fleet`, `relay`,
`proxy`, `server`, `process`, and the command line on top. `sim` stands apart: it imports
nothing of the gateway, and only `process` (for `--simulate`) imports it.
Type-checking-only imports count too: they tie the modules' meanings together all the same.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import gateway

ROOT = Path(gateway.__file__).parent
LAYERS = [
    "gateway",  # the vocabulary: gateway.errors, gateway.routes, gateway.lifecycle
    "dispatch",
    "config",
    "upstream",
    "observe",
    "fleet",
    "relay",
    "proxy",
    "server",
    "process",
    "cli",
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imported(name: str, path: Path) -> set[str]:
    """The gateway modules `name` imports, resolved to the longest known module name."""
    is_package = path.name == "__init__.py"
    base = name.split(".") if is_package else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                anchor = base[: len(base) - node.level + 1]
                module = ".".join([*anchor, *([module] if module else [])])
            targets = [module] + [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


GRAPH = {name: imported(name, path) for name, path in MODULES.items()}


def layer(name: str) -> str:
    """The layer a module belongs to: its package under gateway, or the vocabulary."""
    parts = name.split(".")
    if name in ("gateway.cli", "gateway.__main__"):
        return "cli"
    return parts[1] if len(parts) > 1 and (ROOT / parts[1]).is_dir() else "gateway"


def test_every_module_has_a_known_layer() -> None:
    """A new package must be placed in LAYERS (or be the simulator) before it is used."""
    unknown = {name for name in MODULES if layer(name) not in [*LAYERS, "sim"]}
    assert not unknown


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_go_only_downward(name: str) -> None:
    """A module imports only from its own layer or a lower one; `sim` imports only itself."""
    own = layer(name)
    for target in GRAPH[name]:
        other = layer(target)
        if own == "sim":
            assert other == "sim", f"{name} imports {target}: the simulator stands apart"
        elif other == "sim":
            assert own == "process", f"{name} imports the simulator; only process/ may"
        else:
            assert LAYERS.index(other) <= LAYERS.index(own), f"{name} ({own}) imports {target}"


def test_no_import_cycles() -> None:
    """No module reaches itself through its imports (Tarjan's strongly connected parts)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in GRAPH[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            part = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                part.append(top)
                if top == node:
                    break
            if len(part) > 1:
                cycles.append(sorted(part))

    for node in GRAPH:
        if node not in index:
            visit(node)
    assert cycles == []


def test_every_package_says_what_it_owns_and_may_import() -> None:
    """Each shell package opens with a docstring naming what it may import."""
    for package in LAYERS[2:-1]:
        doc = ast.get_docstring(ast.parse((ROOT / package / "__init__.py").read_text()))
        assert doc, package
        assert "May import" in doc, package
