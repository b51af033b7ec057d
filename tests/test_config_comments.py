"""The sample files' comments keep up with the schema: where a comment lists the values a
setting accepts, it lists exactly those the schema accepts (a newcomer picks from it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gateway.dispatch.strategies import STRATEGIES

ROOT = Path(__file__).resolve().parents[1]
# `strategy = "least_busy"   # a | b | c`, in a file or a README code block
STRATEGY_LINE = re.compile(r'^strategy = "\w+"\s+#\s*(.+)$', re.MULTILINE)
FILES = [ROOT / "config.toml", ROOT / "gateway" / "defaults" / "config.toml", ROOT / "README.md"]


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_strategy_comment_lists_every_accepted_strategy(path: Path) -> None:
    """The comment on `strategy` names each strategy of the schema's table, and no other."""
    comments = STRATEGY_LINE.findall(path.read_text(encoding="utf-8"))
    assert comments, f"{path.name} has no commented `strategy =` line"
    for comment in comments:
        listed = {name.strip() for name in comment.split("|")}
        assert listed == set(STRATEGIES), comment
