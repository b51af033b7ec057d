"""Where an instance's requests go: its base URL and the headers every request to it carries."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Endpoint:
    """Where the proxy sends an instance's requests: its base URL and the headers it gets."""

    name: str
    url: str
    headers: dict[str, str]
    # It runs vLLM's priority scheduler: requests to it carry their key's `priority`.
    priority_scheduling: bool = False
