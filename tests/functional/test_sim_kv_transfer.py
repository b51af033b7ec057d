"""The simulated vLLM's KV connector (prefill/decode disaggregation), over HTTP on 127.0.0.1:
the prefill leg's params and held blocks, the decode leg's transfer, fallbacks and expiry."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.sim.sim_kv_transfer import KvConnector, KvRegistry
from gateway.sim.sim_vllm import SimConfig, SimInstance, SimStats, count_tokens
from loadtest import harness

PROMPT = "abcd" * 520  # 520 simulator tokens: 32 full blocks of 16, and 8 tokens more
TOKENS = 520
BLOCKS = TOKENS // 16
PREFILL = 2000.0  # tokens/s: a whole-prompt prefill takes 0.26 s, the 8-token tail 4 ms
LINK = 32 * 16 * 819_200 / 0.15  # bytes/s: reading the 32 blocks takes 0.15 s
REQUEST_ID = "pd-req-1"


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """A plain aiohttp client session."""
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def sims() -> AsyncIterator[list[SimInstance]]:
    """Started simulators, stopped after the test."""
    started: list[SimInstance] = []
    yield started
    for sim in started:
        await sim.stop()


async def start(sims: list[SimInstance], **overrides: Any) -> SimInstance:
    sim = SimInstance(SimConfig(**{"kv_transfer": True, **overrides}))
    await sim.start()
    sims.append(sim)
    return sim


def prefill_leg(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg of `body` as vLLM's proxies (and vllm-router) send it."""
    leg = {**body, "max_tokens": 1, "stream": False}
    leg.pop("stream_options", None)
    leg["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    return leg


def completion(**extra: Any) -> dict[str, Any]:
    return {"model": "sim-model", "prompt": PROMPT, "max_tokens": 4, **extra}


async def post(
    http: aiohttp.ClientSession, sim: SimInstance, body: dict[str, Any]
) -> dict[str, Any]:
    """A non-streamed completion; its JSON answer."""
    headers = {"X-Request-Id": REQUEST_ID}
    async with http.post(sim.url + "/v1/completions", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        answer: dict[str, Any] = await resp.json()
        return answer


async def stream_ttft(
    http: aiohttp.ClientSession, sim: SimInstance, body: dict[str, Any]
) -> tuple[float, str]:
    """A streamed completion: seconds to its first data line, and the text it streamed."""
    payload = {**body, "stream": True}
    started = time.perf_counter()
    first, text = None, ""
    headers = {"X-Request-Id": REQUEST_ID}
    async with http.post(sim.url + "/v1/completions", json=payload, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data: {"):
                first = first or time.perf_counter() - started
                text += line.decode().split('"text":"')[1].split('"')[0]
    assert first is not None
    return first, text


def held(sim: SimInstance) -> int:
    """Blocks the instance holds for decode instances now (expired ones freed first)."""
    assert sim.kv is not None
    return sim.kv.blocks_held()


async def sim_metrics(http: aiohttp.ClientSession, sim: SimInstance) -> dict[str, float]:
    async with http.get(sim.url + "/metrics") as resp:
        text = await resp.text()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


async def test_prefill_leg_answers_params_and_holds_the_full_blocks(
    sims: list[SimInstance], http: aiohttp.ClientSession
) -> None:
    """The prefill leg answers one token and params naming its 32 full blocks, which it holds."""
    producer = await start(sims)
    answer = await post(http, producer, prefill_leg(completion()))
    assert answer["usage"]["completion_tokens"] == 1
    assert answer["kv_transfer_params"] == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": list(range(BLOCKS)),
        "remote_engine_id": producer.kv and producer.kv.engine_id,
        "remote_request_id": f"cmpl-{REQUEST_ID}",
        "remote_host": "127.0.0.1",
        "remote_port": int(producer.url.rsplit(":", 1)[1]),
        "tp_size": 1,
    }
    assert list(answer)[-1] == "kv_transfer_params"
    assert held(producer) == BLOCKS
    assert producer.stats.kv_produced == 1
    # vLLM counts held blocks as used KV cache: 32 x 16 of 16 slots x 2,048 tokens.
    assert producer.engine.kv_cache_usage == pytest.approx(BLOCKS * 16 / (16 * 2048))
    metrics = await sim_metrics(http, producer)
    assert metrics["sim:kv_blocks_held"] == BLOCKS
    assert metrics["sim:kv_produced_total"] == 1


async def test_a_prompt_shorter_than_a_block_holds_nothing(
    sims: list[SimInstance], http: aiohttp.ClientSession
) -> None:
    """Under 16 tokens there is no full block: an empty id list, and nothing held."""
    producer = await start(sims)
    answer = await post(http, producer, prefill_leg(completion(prompt="abcd" * 15)))
    assert answer["kv_transfer_params"]["remote_block_ids"] == []
    assert held(producer) == 0


async def test_decode_leg_reads_the_blocks_and_skips_their_prefill(
    sims: list[SimInstance], http: aiohttp.ClientSession
) -> None:
    """With valid params the decode instance waits the transfer, prefills only the 8-token
    tail, streams as asked, and the producer frees the blocks it read."""
    producer = await start(sims, speed=50.0)
    decoder = await start(sims, prefill_tokens_per_s=PREFILL, kv_link_bytes_per_s=LINK)
    params = (await post(http, producer, prefill_leg(completion())))["kv_transfer_params"]
    ttft, text = await stream_ttft(http, decoder, {**completion(), "kv_transfer_params": params})
    # 0.15 s of transfer and 8 / 2,000 s of prefill, not the 0.26 s of the whole prompt.
    assert 0.15 <= ttft <= 0.15 + 0.004 + 0.08
    assert count_tokens(text) == 4
    assert decoder.stats.prefill_tokens_computed == TOKENS - BLOCKS * 16
    assert decoder.stats.prompt_tokens == TOKENS  # usage still counts the whole prompt
    assert (decoder.stats.kv_transfers, decoder.stats.kv_fallbacks) == (1, 0)
    assert held(producer) == 0
    assert producer.stats.kv_blocks_expired == 0
    assert [*producer.stats.seen_request_ids, *decoder.stats.seen_request_ids] == [REQUEST_ID] * 2


async def test_a_prompt_of_whole_blocks_still_prefills_its_last_token(
    sims: list[SimInstance], http: aiohttp.ClientSession
) -> None:
    """All 512 tokens arrive in blocks, yet the last one is computed again for its logits."""
    producer, decoder = await start(sims), await start(sims)
    body = completion(prompt="abcd" * 512)
    params = (await post(http, producer, prefill_leg(body)))["kv_transfer_params"]
    await post(http, decoder, {**body, "kv_transfer_params": params})
    assert decoder.stats.prefill_tokens_computed == 1
    assert decoder.stats.kv_transfers == 1


async def test_params_are_read_once(sims: list[SimInstance], http: aiohttp.ClientSession) -> None:
    """A second decode leg with the same params finds the blocks freed and prefills it all."""
    producer, decoder = await start(sims), await start(sims)
    params = (await post(http, producer, prefill_leg(completion())))["kv_transfer_params"]
    for _ in range(2):
        await post(http, decoder, {**completion(), "kv_transfer_params": params})
    assert (decoder.stats.kv_transfers, decoder.stats.kv_fallbacks) == (1, 1)
    assert decoder.stats.prefill_tokens_computed == (TOKENS - BLOCKS * 16) + TOKENS


@pytest.mark.parametrize(
    "spoil",
    [
        {"remote_request_id": "cmpl-someone-else"},
        {"remote_engine_id": "sim-127.0.0.1:1"},
        {"remote_port": 1},
        {"remote_host": None},
        {"remote_block_ids": [0, 1, 2]},
        {"remote_block_ids": "0-31"},
        {"do_remote_prefill": "yes"},
    ],
)
async def test_unusable_params_fall_back_to_a_local_prefill(
    sims: list[SimInstance], http: aiohttp.ClientSession, spoil: dict[str, Any]
) -> None:
    """Params naming no held blocks, or malformed, are silently prefilled locally and counted."""
    producer = await start(sims)
    decoder = await start(sims, prefill_tokens_per_s=PREFILL, kv_link_bytes_per_s=LINK)
    params = (await post(http, producer, prefill_leg(completion())))["kv_transfer_params"]
    ttft, _ = await stream_ttft(
        http, decoder, {**completion(), "kv_transfer_params": {**params, **spoil}}
    )
    assert ttft >= TOKENS / PREFILL  # the whole prompt's prefill, and no transfer before it
    assert decoder.stats.prefill_tokens_computed == TOKENS
    assert (decoder.stats.kv_transfers, decoder.stats.kv_fallbacks) == (0, 1)
    assert held(producer) == BLOCKS  # still waiting
    assert (await sim_metrics(http, decoder))["sim:kv_fallbacks_total"] == 1


async def test_a_stopped_producer_means_a_local_prefill(
    sims: list[SimInstance], http: aiohttp.ClientSession
) -> None:
    """Params naming a stopped instance are unusable: its KV went with it."""
    producer, decoder = await start(sims), await start(sims)
    params = (await post(http, producer, prefill_leg(completion())))["kv_transfer_params"]
    await producer.stop()
    await post(http, decoder, {**completion(), "kv_transfer_params": params})
    assert (decoder.stats.kv_transfers, decoder.stats.kv_fallbacks) == (0, 1)
    assert decoder.stats.prefill_tokens_computed == TOKENS
    assert producer.stats.kv_blocks_held == 0


async def test_unread_blocks_expire_and_then_fall_back(
    sims: list[SimInstance], http: aiohttp.ClientSession
) -> None:
    """After kv_hold_timeout_s the producer frees unread blocks (seen on /metrics), and a late
    decode leg prefills the whole prompt."""
    producer = await start(sims, kv_hold_timeout_s=0.2)
    decoder = await start(sims)
    params = (await post(http, producer, prefill_leg(completion())))["kv_transfer_params"]
    assert (await sim_metrics(http, producer))["sim:kv_blocks_held"] == BLOCKS
    await asyncio.sleep(0.3)
    metrics = await sim_metrics(http, producer)  # reading the metrics frees them
    assert metrics["sim:kv_blocks_held"] == 0
    assert metrics["sim:kv_blocks_expired_total"] == BLOCKS
    assert metrics["vllm:kv_cache_usage_perc"] == 0.0
    await post(http, decoder, {**completion(), "kv_transfer_params": params})
    assert (decoder.stats.kv_transfers, decoder.stats.kv_fallbacks) == (0, 1)


async def test_a_client_leaving_during_the_transfer_frees_the_blocks(
    sims: list[SimInstance], http: aiohttp.ClientSession
) -> None:
    """The producer's blocks are freed (not left to expire) when the decode leg is abandoned."""
    producer = await start(sims)
    decoder = await start(sims, kv_link_bytes_per_s=LINK)
    params = (await post(http, producer, prefill_leg(completion())))["kv_transfer_params"]
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await post(http, decoder, {**completion(), "kv_transfer_params": params})
    deadline = time.monotonic() + 2
    while decoder.stats.cancelled == 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert decoder.stats.cancelled == 1
    assert held(producer) == 0
    assert (producer.stats.kv_blocks_expired, decoder.stats.kv_transfers) == (0, 0)


async def test_the_same_requests_give_the_same_answers_for_a_seed(
    sims: list[SimInstance], http: aiohttp.ClientSession
) -> None:
    """Two fresh pairs with one seed answer the same texts, block ids and counts."""
    runs = []
    for _ in range(2):
        producer, decoder = await start(sims, seed=7), await start(sims, seed=7)
        answers = []
        for n in range(3):
            body = completion(prompt="abcd" * (100 * n + 40))
            params = (await post(http, producer, prefill_leg(body)))["kv_transfer_params"]
            answer = await post(http, decoder, {**body, "kv_transfer_params": params})
            answers.append((params["remote_block_ids"], answer["choices"][0]["text"]))
        runs.append((answers, producer.stats.kv_produced, decoder.stats.prefill_tokens_computed))
    assert runs[0] == runs[1]
    assert [ids for ids, _ in runs[0][0]] == [[0, 1], list(range(2, 10)), list(range(10, 25))]


def _without_created(answer: bytes) -> bytes:
    head, _, tail = answer.partition(b'"created":')
    return head + tail.split(b",", 1)[1]


async def test_requests_without_params_are_served_as_before(
    sims: list[SimInstance], http: aiohttp.ClientSession
) -> None:
    """With the connector on, a request without params gets the same bytes as with it off;
    with it off, params are ignored: no field in the answer, no sim: metrics."""
    on, off = await start(sims, seed=3), await start(sims, seed=3, kv_transfer=False)
    bodies = []
    for sim in (on, off):
        async with http.post(sim.url + "/v1/completions", json=completion()) as resp:
            bodies.append(_without_created(await resp.read()))
    assert bodies[0] == bodies[1]
    answer = await post(http, off, prefill_leg(completion()))
    assert "kv_transfer_params" not in answer
    assert off.kv is None
    assert off.stats.kv_produced == 0
    assert not [name for name in await sim_metrics(http, off) if name.startswith("sim:")]


async def test_params_that_are_not_an_object_are_refused(
    sims: list[SimInstance], http: aiohttp.ClientSession
) -> None:
    """With the connector on, kv_transfer_params must be an object, as vLLM's model says."""
    sim = await start(sims)
    body = {**completion(), "kv_transfer_params": "do_remote_decode"}
    async with http.post(sim.url + "/v1/completions", json=body) as resp:
        assert resp.status == 400
        assert "kv_transfer_params" in (await resp.json())["error"]["message"]


def test_holds_expire_on_the_clock_without_a_timer() -> None:
    """The connector frees expired holds whenever it is asked, against its clock."""
    now = [100.0]
    stats = SimStats()
    connector = KvConnector(
        SimConfig(kv_transfer=True, kv_hold_timeout_s=10), stats, KvRegistry(), lambda: now[0]
    )
    connector.bind("127.0.0.1", 9)
    connector.produce("a", 64)
    now[0] = 105.0
    connector.produce("b", 32)
    now[0] = 110.0
    assert connector.blocks_held() == 2  # "a" expired at 110, "b" holds until 115
    assert (stats.kv_blocks_expired, stats.kv_blocks_held) == (4, 2)
    assert repr(connector) == "KvConnector(engine_id='sim-127.0.0.1:9', holds=1, blocks_held=2)"


@pytest.mark.parametrize(
    ("field", "value"),
    [("kv_bytes_per_token", 0), ("kv_link_bytes_per_s", 0.0), ("kv_hold_timeout_s", -1.0)],
)
def test_connector_settings_are_validated(field: str, value: float) -> None:
    """Sizes and rates of the KV connector must be positive."""
    with pytest.raises(ValueError, match=field):
        SimConfig(**{field: value})


async def test_a_fleet_process_with_kv_transfer_disaggregates(
    http: aiohttp.ClientSession,
) -> None:
    """harness.fleet_process(kv_transfer=True) passes --kv-transfer: its instances read each
    other's blocks, as vLLM instances on one NIXL network do."""
    async with harness.fleet_process([1.0, 1.0], max_num_seqs=4, seed=0, kv_transfer=True) as fleet:
        prefill_url, decode_url = fleet.urls
        async with http.post(prefill_url + "/v1/completions", json=prefill_leg(completion())) as r:
            params = (await r.json())["kv_transfer_params"]
        body = {**completion(), "kv_transfer_params": params}
        async with http.post(decode_url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
        async with http.get(decode_url + "/metrics") as resp:
            text = await resp.text()
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert (samples["sim:kv_transfers_total"], samples["sim:kv_fallbacks_total"]) == (1, 0)
