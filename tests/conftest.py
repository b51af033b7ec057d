"""Fixtures more than one test file uses by name (`usefixtures`), so they live here rather
than in a module each test file would import without using; and the test tiers.

`pytest -m "not slow"` is the edit-test loop (under a minute on two cores); plain `pytest`
runs everything. Slow is what starts real servers, processes or Redis, or waits seconds:
marked here by folder and by file, and with `@pytest.mark.slow` on the few slow tests of a
file that is otherwise quick.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _cli_helpers import KEY

TESTS = Path(__file__).parent
SLOW = [
    TESTS / "functional",  # a gateway and simulated instances on loopback, processes, Redis
    TESTS / "test_packaging.py",  # builds and installs the wheel
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    slow = pytest.mark.slow
    for item in items:
        if any(item.path.is_relative_to(place) for place in SLOW):
            item.add_marker(slow)


@pytest.fixture
def keyed(monkeypatch: pytest.MonkeyPatch) -> None:
    """GATEWAY_API_KEY is set for the test."""
    monkeypatch.setenv("GATEWAY_API_KEY", KEY)
