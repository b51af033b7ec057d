"""The benchmark page's plots (loadtest/figures.py): each one drawn, valid SVG, the same to
the byte when drawn again, and the committed files what the committed results give."""

from __future__ import annotations

import re
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from loadtest import figures

PAGE = figures.ROOT / "docs" / "benchmarks.md"
SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def drawn(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("figures")
    figures.render(out=out)
    return out


def version_of(svg: bytes) -> str:
    found = re.search(rb"Matplotlib v([\w.+-]+),", svg)
    assert found, "no matplotlib version in the SVG's metadata"
    return found.group(1).decode()


def test_every_figure_is_drawn_as_svg(drawn: Path) -> None:
    """Each figure of the table is written, parses as SVG, and keeps its text as text
    (no embedded glyphs) and no date."""
    assert sorted(p.name for p in drawn.iterdir()) == sorted(f"{n}.svg" for n in figures.FIGURES)
    for path in drawn.iterdir():
        root = ET.parse(path).getroot()
        assert root.tag == f"{SVG}svg"
        assert next(root.iter(f"{SVG}text"), None) is not None, f"{path.name}: text as glyphs"
        assert b"<dc:date>" not in path.read_bytes()


def test_drawing_again_gives_the_same_bytes(drawn: Path, tmp_path: Path) -> None:
    """The same results give the same files, so a figure changes in git only with its data."""
    figures.render(out=tmp_path)
    for path in drawn.iterdir():
        assert (tmp_path / path.name).read_bytes() == path.read_bytes(), path.name


def test_the_committed_figures_are_the_committed_results(drawn: Path) -> None:
    """docs/figures/ holds what `python -m loadtest.figures` draws now: no figure drifts
    from the results it claims to show (skipped under another matplotlib version, whose
    bytes differ)."""
    for path in drawn.iterdir():
        committed = figures.OUT / path.name
        assert committed.exists(), f"{committed.name} is missing: run python -m loadtest.figures"
        drawn_by = version_of(committed.read_bytes())
        if drawn_by != version_of(path.read_bytes()):
            pytest.skip(f"docs/figures/ was drawn by matplotlib {drawn_by}")
        assert committed.read_bytes() == path.read_bytes(), (
            f"{committed.name} is stale: run python -m loadtest.figures"
        )
    assert sorted(p.name for p in figures.OUT.iterdir()) == sorted(p.name for p in drawn.iterdir())


def test_figures_read_only_tracked_results() -> None:
    """Every file a figure reads is tracked by git, so a local run's results change none."""
    sources = [f"loadtest/results/{s}" for f in figures.FIGURES.values() for s in f.sources]
    listed = subprocess.run(
        ["git", "ls-files", "--error-unmatch", *sources],
        cwd=figures.ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert listed.returncode == 0, listed.stderr


def test_the_page_shows_every_figure() -> None:
    """docs/benchmarks.md embeds each figure and names the command that draws them."""
    text = PAGE.read_text(encoding="utf-8")
    for name in figures.FIGURES:
        assert f"](figures/{name}.svg)" in text, name
    assert "python -m loadtest.figures" in text


def test_an_unknown_figure_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """Naming a figure that does not exist says which there are."""
    with pytest.raises(SystemExit):
        figures.main(["nope"])
    assert "no figure named nope; there are overhead," in capsys.readouterr().err
