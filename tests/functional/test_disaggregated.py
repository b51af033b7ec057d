"""A prefill/decode fleet behind the gateway: the two hops as vLLM's KV connector expects
them, the prompts served whole, and every way the prefill hop falls back."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
from fakes import KEY, Gateway, fleet, gateway_with
from prometheus_client.parser import text_string_to_metric_families

from gateway.sim.sim_vllm import SimConfig

_ids = itertools.count()
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = "tell me more " * 300  # about 900 tokens by the gateway's estimate: over 400
SHORT = "hi there"
CARD = SimConfig(decode_s_per_token=0.002, prefill_tokens_per_s=50_000, max_num_seqs=8)


@asynccontextmanager
async def pd_gateway(
    prefill: SimConfig = CARD, decode: SimConfig = CARD, **channel: Any
) -> AsyncIterator[Gateway]:
    sections = {
        "dispatch": {"health_check_interval": 0.1},
        "prefill": {"long_input_threshold": 400},
    }
    async with fleet(prefill, decode) as sims:
        instances = [
            {"url": sims[0].url, "name": "p", "role": "prefill"},
            {"url": sims[1].url, "name": "d", "role": "decode"},
        ]
        async with gateway_with(
            sims, instances=instances, sections=sections, channel=channel or None
        ) as gw:
            await _until_up(gw)
            yield gw


async def _until_up(gw: Gateway) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(100):
            body = await (await s.get(gw.url + "/admin/instances", headers=AUTH)).json()
            if all(i["available"] for i in body["instances"]):
                return
            await asyncio.sleep(0.05)
    raise AssertionError("the fleet did not come up")


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
        assert status == 200 and text.endswith("data: [DONE]\n\n")
        assert headers["X-Gateway-Instance"] == "d"
        assert gw.sims[0].stats.requests == 0  # the prefill instance never saw it
        assert await metric(gw, "gateway_disaggregated_requests_total", path="whole") == 1


async def test_without_params_the_decode_instance_prefills_and_the_fallback_is_counted() -> None:
    """The prefill instance answers, but its connector is off (no kv_transfer_params): the
    decode hop goes without them and prefills itself, as vLLM does; counted, not hidden."""
    async with pd_gateway() as gw:
        status, text, headers = await chat(gw, LONG, stream_options={"include_usage": True})
        assert status == 200 and text.endswith("data: [DONE]\n\n")
        prefill, decode = gw.sims
        assert prefill.stats.requests == 1 and decode.stats.requests == 1
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
        assert status == 200 and text.endswith("data: [DONE]\n\n")
        assert headers["X-Gateway-Instance"] == "d"
        assert gw.sims[1].stats.completed == 1
        assert await metric(gw, "gateway_prefill_fallbacks_total", reason="prefill_failed") == 1


async def test_a_prefill_instance_that_hangs_is_given_up_after_the_first_token_allowance() -> None:
    async with pd_gateway(timeout={"connect": 2, "read": 0.3, "write": 5}) as gw:
        gw.sims[0].faults.hang_before_headers = True
        status, text, _ = await chat(gw, LONG)
        assert status == 200 and text.endswith("data: [DONE]\n\n")
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


async def test_a_fleet_of_prefill_instances_alone_is_refused_at_load() -> None:
    from gateway.config.schema import VllmSection

    try:
        VllmSection.model_validate(
            {"instances": [{"url": "http://127.0.0.1:1", "role": "prefill"}]}
        )
    except ValueError as exc:
        assert 'role "prefill"' in str(exc)
    else:
        raise AssertionError("a fleet of prefill instances alone was accepted")
