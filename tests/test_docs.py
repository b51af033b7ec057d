"""The docs keep up with the code: every setting documented, every link resolving, every
page listed and none a wall.

A setting the schema accepts but docs/configuration.md never names is one an operator
cannot find; a link into a file or a section that moved is a dead end; a page past a few
hundred lines is read through, not navigated. All fail here, not in review.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from gateway.config.schema import ConfigFile, Settings

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "configuration.md"
PAGES = [
    ROOT / "README.md",
    *sorted((ROOT / "loadtest").rglob("*.md")),
    *sorted((ROOT / "docs").rglob("*.md")),
]
DOCS = sorted((ROOT / "docs").glob("*.md"))
# Past this a page is a wall: split it by concern (operations, deployment, ...). The
# benchmark page is a table of results, one section per scenario, and may run longer.
MOST_LINES = 500
RESULTS_PAGES = {"benchmarks.md"}
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def settings_of(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every field of `model` and of the models nested in it, as dotted paths."""
    found = []
    for name, field in model.model_fields.items():
        found.append(prefix + name)
        for kind in (field.annotation, *getattr(field.annotation, "__args__", ())):
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                found += settings_of(kind, f"{prefix}{name}.")
    return found


SETTINGS = sorted(set(settings_of(ConfigFile) + settings_of(Settings)))


def test_the_schema_is_walked() -> None:
    """The walk reaches nested tables and list items (instances), not just the top level."""
    assert {"gateway.port", "dispatch.health.rise", "vllm.instances.url"} <= set(SETTINGS)


@pytest.mark.parametrize("path", SETTINGS)
def test_every_setting_is_documented(path: str) -> None:
    """Each setting's name appears in the configuration reference as code."""
    assert f"`{path.rsplit('.', 1)[-1]}`" in REFERENCE.read_text(encoding="utf-8")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    """Every link to a file of the repository from README, docs/ and loadtest/ exists."""
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if "://" in target or target.startswith("mailto:"):
            continue
        assert (page.parent / target).exists(), f"{page.name} links to missing {target}"


ANCHORED = re.compile(r"\]\(([^)#\s]*)#([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} (.+?)\s*$", re.MULTILINE)
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def anchors(page: Path) -> set[str]:
    """The anchors GitHub makes of a page's headings: lower case, punctuation dropped but
    hyphens, spaces as hyphens (a repeated heading's -1, -2 suffixes too)."""
    found: set[str] = set()
    text = FENCE.sub("", page.read_text(encoding="utf-8"))  # a `# comment` in code is none
    for heading in HEADING.findall(text):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        candidate, n = slug, 0
        while candidate in found:
            n += 1
            candidate = f"{slug}-{n}"
        found.add(candidate)
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_anchored_links_reach_a_heading(page: Path) -> None:
    """A link to a section (`page.md#section`, `#section`) names a heading that exists, so
    moving a section to another page cannot leave links pointing at nothing."""
    for target, anchor in ANCHORED.findall(page.read_text(encoding="utf-8")):
        if "://" in target or not (target == "" or target.endswith(".md")):
            continue
        linked = page if target == "" else (page.parent / target).resolve()
        assert anchor in anchors(linked), f"{page.name} links to {target}#{anchor}: no heading"


def test_anchors_are_githubs(tmp_path: Path) -> None:
    """Punctuation and code spans leave a heading's anchor, `# lines` in code make none,
    and a repeated heading is numbered."""
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n## Drain (SIGTERM)\n\n```sh\n# a comment\n```\n\n### `reload_on_change`\n\n"
        "## Title\n"
    )
    assert anchors(page) == {"title", "drain-sigterm", "reload_on_change", "title-1"}


@pytest.mark.parametrize(
    "page", [p for p in DOCS if p.name not in RESULTS_PAGES], ids=lambda p: p.name
)
def test_no_page_is_a_wall(page: Path) -> None:
    """A docs page stays within MOST_LINES lines (the results page aside), so it is
    navigated by its headings rather than read through."""
    lines = len(page.read_text(encoding="utf-8").splitlines())
    assert lines <= MOST_LINES, f"{page.name} has {lines} lines: split it by concern"


def test_the_readme_lists_every_docs_page() -> None:
    """README's Documentation section links each page of docs/, so none is found by chance."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    start = readme.index("\n## Documentation\n")
    end = readme.find("\n## ", start + 1)
    index = readme[start : end if end != -1 else len(readme)]
    listed = set(LINK.findall(index))
    assert {f"docs/{page.name}" for page in DOCS} <= listed


def test_the_readme_layout_names_every_module() -> None:
    """README's Layout names each module of each package of the gateway (the simulator
    aside, which it sums up), so a newcomer finds every room from it."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    start = readme.index("\n## Layout\n")
    layout = readme[start : readme.index("\n## ", start + 1)]
    named = set(re.findall(r"[a-z_]+", layout))
    modules = {
        f"{path.parent.name}/{path.stem}"
        for path in (ROOT / "gateway").glob("*/*.py")
        if path.stem != "__init__" and path.parent.name != "sim"
    }
    assert {m for m in modules if m.split("/")[1] not in named} == set()
