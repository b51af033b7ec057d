"""Fixtures the simulated vLLM's tests share: simulators started on 127.0.0.1 and stopped
after the test, and a plain HTTP session."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from _sim_helpers import MakeSim

from gateway.sim.sim_vllm import SimConfig, SimInstance


@pytest.fixture
async def make_sim() -> AsyncIterator[MakeSim]:
    """Factory starting simulators with SimConfig keyword overrides; stops them all afterwards."""
    instances: list[SimInstance] = []

    async def make(**overrides: Any) -> SimInstance:
        instance = SimInstance(SimConfig(**overrides))
        await instance.start()
        instances.append(instance)
        return instance

    yield make
    for instance in instances:
        await instance.stop()


@pytest.fixture
async def sim(make_sim: MakeSim) -> SimInstance:
    """A simulator with the default configuration."""
    return await make_sim()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """A plain aiohttp client session."""
    async with aiohttp.ClientSession() as session:
        yield session
