"""The disaggregation benchmark's fronts before simulated instances with the KV connector on."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from gateway.sim.sim_vllm import SimConfig, SimInstance
from loadtest import baselines
from loadtest.disagg import loadgen
from loadtest.disagg.fronts import Instance, direct, vllm_router_pd

needs_router = pytest.mark.skipif(
    baselines.missing("vllm-router") is not None, reason="vllm-router is not installed"
)


@pytest.fixture
async def pair() -> AsyncIterator[tuple[SimInstance, SimInstance]]:
    """A prefill and a decode instance, both kv_both, stopped after the test."""
    sims = [SimInstance(SimConfig(kv_transfer=True)) for _ in range(2)]
    for sim in sims:
        await sim.start()
    yield sims[0], sims[1]
    for sim in sims:
        await sim.stop()


@needs_router
async def test_vllm_router_pd_sends_two_legs_and_the_decode_leg_transfers(
    pair: tuple[SimInstance, SimInstance],
) -> None:
    """Through vllm-router's PD mode a streamed request is prefilled on one instance and
    decoded on the other, which reads its KV; both legs carry one X-Request-Id."""
    prefill, decode = pair
    instances = [Instance(prefill.url, "prefill"), Instance(decode.url, "decode")]
    async with vllm_router_pd(instances) as url, aiohttp.ClientSession() as http:
        outcome = await loadgen.stream(http, url, loadgen.completion(1, 8), "client-id")
    assert (outcome.error, outcome.tokens) == (None, 8)
    assert (prefill.stats.kv_produced, decode.stats.kv_transfers) == (1, 1)
    assert (decode.stats.kv_fallbacks, decode.stats.prefill_tokens_computed) == (0, 1)
    assert prefill.kv is not None
    assert prefill.kv.blocks_held() == 0
    ids = [*prefill.stats.seen_request_ids, *decode.stats.seen_request_ids]
    assert len(ids) == 2
    assert ids[0] == ids[1]


async def test_two_legs_by_hand_transfer_too(pair: tuple[SimInstance, SimInstance]) -> None:
    """The calibration's decode setup: prefill leg, then decode leg with its params."""
    prefill, decode = pair
    async with direct([Instance(decode.url)]) as url, loadgen.session() as http:
        outcome = await loadgen.two_legs(http, prefill.url, url, 8, "cal")(0)
    assert (outcome.error, outcome.tokens) == (None, 8)
    assert decode.stats.kv_transfers == 1
    assert list(decode.stats.seen_request_ids) == ["cal-0"]
