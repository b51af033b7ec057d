"""Fixtures more than one test file uses by name (`usefixtures`), so they live here rather
than in a module each test file would import without using."""

from __future__ import annotations

import pytest
from _cli_helpers import KEY


@pytest.fixture
def keyed(monkeypatch: pytest.MonkeyPatch) -> None:
    """GATEWAY_API_KEY is set for the test."""
    monkeypatch.setenv("GATEWAY_API_KEY", KEY)
