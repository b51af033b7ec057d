"""A prefill/decode fleet behind the gateway: the two hops as vLLM's KV connector expects
them, the prompts served whole, and every way the prefill hop falls back."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import aiohttp
import pytest
from fakes import KEY, Gateway, fleet, gateway_with, until_available
from prometheus_client.parser import text_string_to_metric_families

from gateway.config.schema import VllmSection
from gateway.sim.sim_vllm import SimConfig

_ids = itertools.count()
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = "tell me more " * 300  # about 900 tokens by the gateway's estimate: over 400
SHORT = "hi there"
CARD = SimConfig(decode_s_per_token=0.002, prefill_tokens_per_s=50_000, max_num_seqs=8)
# vLLM's NixlConnector on (kv_role kv_both), as a disaggregated fleet runs every instance;
# a link fast enough that moving these prompts stays cheaper than computing them again.
KV = replace(CARD, kv_transfer=True, kv_link_bytes_per_s=1e12)
# Long prompts (over 400 tokens) go in two hops before any rate is learned, and after it
# too: at 50,000 tokens/s their prefill takes longer than this TPOT objective.
SECTIONS = {
    "dispatch": {"health_check_interval": 0.1},
    "prefill": {"long_input_threshold": 400},
    "slo": {"tpot": 0.005},
}


@asynccontextmanager
async def pd_gateway(
    prefill: SimConfig = CARD, decode: SimConfig = CARD, **channel: Any
) -> AsyncIterator[Gateway]:
    async with fleet(prefill, decode) as sims:
        instances = [
            {"url": sims[0].url, "name": "p", "role": "prefill"},
            {"url": sims[1].url, "name": "d", "role": "decode"},
        ]
        async with gateway_with(
            sims, instances=instances, sections=SECTIONS, channel=channel or None
        ) as gw:
            await until_available(gw)
            yield gw


async def chat(gw: Gateway, content: str, **fields: Any) -> tuple[int, str, Mapping[str, str]]:
    body = {
        "messages": [{"role": "user", "content": f"{next(_ids):06d} {content}"}],
        "max_tokens": 5,
        "stream": True,
        **fields,
    }
    async with (
        aiohttp.ClientSession() as s,
        s.post(gw.url + "/v1/chat/completions", json=body, headers=AUTH) as resp,
    ):
        return resp.status, await resp.text(), resp.headers


async def metric(gw: Gateway, name: str, **labels: str) -> float:
    async with aiohttp.ClientSession() as s:
        text = await (await s.get(gw.url + "/metrics")).text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise AssertionError(f"no sample {name} {labels}")


async def test_a_short_prompt_is_served_whole_by_the_decode_instance() -> None:
    async with pd_gateway() as gw:
        status, text, headers = await chat(gw, SHORT)
        assert status == 200
        assert text.endswith("data: [DONE]\n\n")
        assert headers["X-Gateway-Instance"] == "d"
        assert gw.sims[0].stats.requests == 0  # the prefill instance never saw it
        assert await metric(gw, "gateway_disaggregated_requests_total", path="whole") == 1


async def test_a_long_prompt_is_prefilled_on_the_prefill_instance_and_decoded_on_the_other() -> (
    None
):
    async with pd_gateway(KV, KV) as gw:
        status, text, headers = await chat(gw, LONG)
        assert status == 200
        assert text.endswith("data: [DONE]\n\n")
        assert headers["X-Gateway-Instance"] == "d"
        prefill, decode = gw.sims
        # The decode instance read the prompt's KV blocks instead of computing them: it
        # prefilled only the tail of the last, partial block (and the last token).
        assert prefill.stats.kv_produced == 1
        assert decode.stats.kv_transfers == 1
        assert decode.stats.kv_fallbacks == 0
        assert decode.stats.prefill_tokens_computed < 16
        assert prefill.stats.prefill_tokens_computed > 800
        assert prefill.stats.kv_blocks_held == 0  # read, so freed
        # One X-Request-Id on both hops; five tokens streamed, one computed by the prefill.
        request_id = headers["X-Request-Id"]
        assert list(prefill.stats.seen_request_ids) == [request_id]
        assert list(decode.stats.seen_request_ids) == [request_id]
        assert (prefill.stats.generation_tokens, decode.stats.generation_tokens) == (1, 5)
        assert await metric(gw, "gateway_disaggregated_requests_total", path="two_hop") == 1
        for phase in ("prefill_queue", "prefill", "decode_queue", "decode"):
            count = await metric(gw, "gateway_disaggregated_phase_seconds_count", phase=phase)
            assert count == 1, phase


async def test_a_whole_answer_goes_in_two_hops_too() -> None:
    async with pd_gateway(KV, KV) as gw, aiohttp.ClientSession() as s:
        body = {"model": "sim-model", "prompt": f"{next(_ids)} {LONG}", "max_tokens": 3}
        async with s.post(gw.url + "/v1/completions", json=body, headers=AUTH) as resp:
            assert resp.status == 200
            answer = await resp.json()
        assert answer["usage"]["completion_tokens"] == 3
        # The decode instance's answer goes back as it wrote it, params and all: vLLM's
        # own answers carry them too (null on a decode).
        assert gw.sims[1].stats.kv_transfers == 1


async def test_a_decode_instance_that_fails_is_retried_elsewhere_with_the_same_params() -> None:
    """Two decode instances: the first answers 503 before anything is sent; the retry on
    the other reads the same blocks."""
    sections = {**SECTIONS, "dispatch": {"health_check_interval": 0.1, "strategy": "round_robin"}}
    async with fleet(KV, KV, KV) as sims:
        instances = [
            {"url": sims[0].url, "name": "p", "role": "prefill"},
            {"url": sims[1].url, "name": "d1", "role": "decode"},
            {"url": sims[2].url, "name": "d2", "role": "decode"},
        ]
        async with gateway_with(sims, instances=instances, sections=sections) as gw:
            await until_available(gw)
            sims[1].faults.busy = True
            sims[2].faults.busy = False
            for _ in range(2):  # round robin: one of the two starts at d1
                status, text, headers = await chat(gw, LONG)
                assert status == 200
                assert text.endswith("data: [DONE]\n\n")
                assert headers["X-Gateway-Instance"] == "d2"
            assert sims[2].stats.kv_transfers == 2
            assert sims[2].stats.kv_fallbacks == 0
            assert sims[0].stats.kv_produced == 2
            assert sims[0].stats.kv_blocks_held == 0


async def test_a_client_that_leaves_during_the_prefill_aborts_it_there() -> None:
    slow = replace(KV, prefill_tokens_per_s=500)  # about two seconds for this prompt
    async with pd_gateway(slow, KV) as gw:
        body = {"messages": [{"role": "user", "content": LONG}], "max_tokens": 5, "stream": True}
        async with aiohttp.ClientSession() as s:
            request = s.post(gw.url + "/v1/chat/completions", json=body, headers=AUTH)
            task = asyncio.ensure_future(request)
            for _ in range(100):
                if gw.sims[0].stats.running:
                    break
                await asyncio.sleep(0.01)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for _ in range(100):
            if gw.sims[0].stats.cancelled:
                break
            await asyncio.sleep(0.02)
        assert gw.sims[0].stats.cancelled == 1
        assert gw.sims[0].stats.kv_produced == 0  # never finished: nothing held
        assert gw.sims[1].stats.requests == 0  # and no decode hop was sent


async def test_without_params_the_decode_instance_prefills_and_the_fallback_is_counted() -> None:
    """The prefill instance answers, but its connector is off (no kv_transfer_params): the
    decode hop goes without them and prefills itself, as vLLM does; counted, not hidden."""
    async with pd_gateway() as gw:
        status, text, headers = await chat(gw, LONG, stream_options={"include_usage": True})
        assert status == 200
        assert text.endswith("data: [DONE]\n\n")
        prefill, decode = gw.sims
        assert prefill.stats.requests == 1
        assert decode.stats.requests == 1
        # Both hops carried the request's one id.
        request_id = headers["X-Request-Id"]
        assert list(prefill.stats.seen_request_ids) == [request_id]
        assert list(decode.stats.seen_request_ids) == [request_id]
        # The prefill hop computed the prompt and one token, and streamed nothing.
        assert prefill.stats.generation_tokens == 1
        assert decode.stats.generation_tokens == 5
        assert '"usage"' in text  # the client's stream_options reached the decode hop
        assert await metric(gw, "gateway_prefill_fallbacks_total", reason="no_params") == 1
        assert await metric(gw, "gateway_disaggregated_requests_total", path="two_hop") == 0


async def test_a_failing_prefill_instance_falls_back_to_a_local_prefill() -> None:
    async with pd_gateway() as gw:
        gw.sims[0].faults.status = 500
        status, text, headers = await chat(gw, LONG)
        assert status == 200
        assert text.endswith("data: [DONE]\n\n")
        assert headers["X-Gateway-Instance"] == "d"
        assert gw.sims[1].stats.completed == 1
        assert await metric(gw, "gateway_prefill_fallbacks_total", reason="prefill_failed") == 1


async def test_a_prefill_instance_that_hangs_is_given_up_after_the_first_token_allowance() -> None:
    async with pd_gateway(timeout={"connect": 2, "read": 0.3, "write": 5}) as gw:
        gw.sims[0].faults.hang_before_headers = True
        status, text, _ = await chat(gw, LONG)
        assert status == 200
        assert text.endswith("data: [DONE]\n\n")
        assert await metric(gw, "gateway_prefill_fallbacks_total", reason="prefill_failed") == 1
        # The hung prefill was aborted there, not left running.
        for _ in range(50):
            if gw.sims[0].stats.cancelled == 1:
                break
            await asyncio.sleep(0.02)
        assert gw.sims[0].stats.cancelled == 1


async def test_a_client_may_not_set_kv_transfer_params() -> None:
    """They name hosts and KV blocks on the instances: in a disaggregated fleet only the
    gateway sets them."""
    async with pd_gateway() as gw:
        params = {"do_remote_prefill": True, "remote_host": "10.0.0.9", "remote_port": 5600}
        status, text, _ = await chat(gw, LONG, kv_transfer_params=params)
        assert status == 400
        assert "kv_transfer_params" in text
        assert gw.sims[0].stats.requests == gw.sims[1].stats.requests == 0


async def test_admin_instances_shows_each_role() -> None:
    async with pd_gateway() as gw, aiohttp.ClientSession() as s:
        body = await (await s.get(gw.url + "/admin/instances", headers=AUTH)).json()
        assert {i["name"]: i["role"] for i in body["instances"]} == {"p": "prefill", "d": "decode"}


def test_a_fleet_of_prefill_instances_alone_is_refused_at_load() -> None:
    with pytest.raises(ValueError, match='role "prefill"'):
        VllmSection.model_validate(
            {"instances": [{"url": "http://127.0.0.1:1", "role": "prefill"}]}
        )


async def test_a_prefill_instance_killed_mid_run_loses_no_request_and_leaves_no_blocks() -> None:
    """Requests in flight on the killed instance fall back (or go to the other prefill
    instance); every one is answered; after the hold timeout no block stays held."""
    slow = replace(KV, prefill_tokens_per_s=20_000, kv_hold_timeout_s=0.5)
    async with fleet(slow, slow, KV) as sims:
        instances = [
            {"url": sims[0].url, "name": "p1", "role": "prefill"},
            {"url": sims[1].url, "name": "p2", "role": "prefill"},
            {"url": sims[2].url, "name": "d", "role": "decode"},
        ]
        async with gateway_with(sims, instances=instances, sections=SECTIONS) as gw:
            await until_available(gw)

            async def later(delay: float) -> tuple[int, str, Mapping[str, str]]:
                await asyncio.sleep(delay)
                return await chat(gw, LONG)

            requests = [asyncio.ensure_future(later(i * 0.01)) for i in range(40)]
            await asyncio.sleep(0.15)
            await sims[0].stop()  # killed: open connections cut, its held blocks gone
            answers = await asyncio.gather(*requests)
            assert [status for status, _, _ in answers] == [200] * 40
            assert all(text.endswith("data: [DONE]\n\n") for _, text, _ in answers)
            assert sims[0].stats.kv_produced > 0  # it did serve some before it died
            # Every answer came from the decode instance: read from a prefill instance, or
            # prefilled there (its params died with their instance, the prefill hop did,
            # or the prefill side's queue made serving it whole the cheaper).
            assert sims[2].stats.completed == 40
            two_hop = await metric(gw, "gateway_disaggregated_requests_total", path="two_hop")
            whole = await metric(gw, "gateway_disaggregated_requests_total", path="whole")
            assert two_hop + whole == 40
            assert sims[2].stats.kv_transfers + sims[2].stats.kv_fallbacks == two_hop
            await asyncio.sleep(0.6)  # past the hold timeout
            assert sims[1].kv is not None
            assert sims[1].kv.blocks_held() == 0
