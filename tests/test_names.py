"""One meaning per name: a class or type alias of the gateway is defined in one place."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

GATEWAY = Path(__file__).resolve().parents[1] / "gateway"


def _definitions() -> dict[str, set[str]]:
    """Each capitalised module-level name -> what it is ("class" or an alias's text)."""
    found: dict[str, set[str]] = defaultdict(set)
    for path in sorted(GATEWAY.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                found[node.name].add(f"class in {path.relative_to(GATEWAY)}")
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    name = target.id if isinstance(target, ast.Name) else ""
                    if name[:1].isupper() and not name.isupper() and node.value is not None:
                        found[name].add(ast.unparse(node.value))
    return found


def test_no_name_means_two_things() -> None:
    """No two classes share a name, and a type alias defined twice says the same both times."""
    twice = {name: sorted(what) for name, what in _definitions().items() if len(what) > 1}
    assert twice == {}
