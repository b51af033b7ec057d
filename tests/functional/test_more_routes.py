"""vLLM's other routes through the gateway: responses, Anthropic's messages, tokenize,
rerank, score, pooling, classify and audio uploads, routed by model, behind the key, under
every prefix."""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest
import structlog
from fakes import KEY, Gateway, fleet, gateway_with

from gateway.routes import ROUTES
from gateway.sim.sim_vllm import SimConfig, SimInstance

FAST = SimConfig(decode_s_per_token=0.001, prefill_tokens_per_s=1e6)
OTHER = SimConfig(decode_s_per_token=0.001, prefill_tokens_per_s=1e6, model="other-model")
AUTH = {"Authorization": f"Bearer {KEY}"}

# A request each JSON route's instance answers 200, and a key its answer must have.
BODIES: dict[str, tuple[dict[str, Any], str]] = {
    "/v1/responses": ({"input": "hello", "max_output_tokens": 3}, "output"),
    "/v1/messages": ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}, "content"),
    "/v1/messages/count_tokens": (
        {"messages": [{"role": "user", "content": "hi"}]},
        "input_tokens",
    ),
    "/tokenize": ({"prompt": "hello there"}, "tokens"),
    "/detokenize": ({"tokens": [1, 2, 3]}, "prompt"),
    "/rerank": ({"query": "q", "documents": ["a", "b"]}, "results"),
    "/v2/rerank": ({"query": "q", "documents": ["a", "b"]}, "results"),
    "/score": ({"text_1": "q", "text_2": ["a", "b"]}, "data"),
    "/pooling": ({"input": "hello"}, "data"),
    "/classify": ({"input": ["good", "bad"]}, "data"),
}


@pytest.fixture
async def gw() -> AsyncIterator[Gateway]:
    """Two instances, each serving its own model, behind a gateway with a base_url path."""
    async with (
        fleet(FAST, OTHER) as sims,
        gateway_with(sims, sections={"gateway": {"base_url": "http://127.0.0.1:1/api"}}) as gw,
    ):
        yield gw


def served(gw: Gateway, upstream_path: str) -> list[int]:
    return [s.stats.paths[upstream_path] for s in gw.sims]


def is_error(upstream_path: str, answer: dict[str, Any], code: str, anthropic_type: str) -> bool:
    """Whether the gateway's error is `code` in OpenAI's shape or, on Anthropic's routes,
    of `anthropic_type` in Anthropic's."""
    if next(r.api for r in ROUTES if r.upstream_path == upstream_path) == "anthropic":
        return bool(answer["type"] == "error" and answer["error"]["type"] == anthropic_type)
    return bool(answer["error"]["code"] == code)


def sim_named(gw: Gateway, model: str) -> SimInstance:
    return next(s for s in gw.sims if s.config.model == model)


async def post(
    gw: Gateway, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any], dict[str, str]]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(gw.url + path, json=body, headers=headers if headers is not None else AUTH) as r,
    ):
        return r.status, json.loads(await r.read()), dict(r.headers)


def test_every_route_of_the_table_has_a_test_body() -> None:
    """Each proxied JSON route is exercised by the route tests below (none is forgotten)."""
    json_routes = {r.upstream_path for r in ROUTES if not r.form} - {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
    }
    assert json_routes == set(BODIES)


@pytest.mark.parametrize("upstream_path", sorted(BODIES))
@pytest.mark.parametrize("model", ["sim-model", "other-model"])
async def test_each_route_reaches_an_instance_serving_its_model(
    gw: Gateway, upstream_path: str, model: str
) -> None:
    """A request on each route goes to the instance that serves its model, on vLLM's path."""
    body, key = BODIES[upstream_path]
    path = upstream_path if upstream_path.startswith("/v1/") else "/v1" + upstream_path
    if upstream_path.startswith("/v2/"):
        path = upstream_path
    status, answer, headers = await post(gw, path, {**body, "model": model})
    assert status == 200, answer
    assert key in answer
    target = sim_named(gw, model)
    assert target.stats.paths[upstream_path] == 1
    assert sum(served(gw, upstream_path)) == 1
    assert headers["X-Gateway-Instance"] in gw.names()


@pytest.mark.parametrize(
    ("path", "upstream_path"),
    [
        ("/score", "/score"),
        ("/v1/score", "/score"),
        ("/api/score", "/score"),
        ("/api/v1/score", "/score"),
        ("/rerank", "/rerank"),
        ("/v1/rerank", "/rerank"),
        ("/v2/rerank", "/v2/rerank"),
        ("/api/v2/rerank", "/v2/rerank"),
        ("/tokenize", "/tokenize"),
        ("/api/v1/responses", "/v1/responses"),
        ("/responses", "/v1/responses"),
        ("/api/v1/messages", "/v1/messages"),
        ("/messages/count_tokens", "/v1/messages/count_tokens"),
    ],
)
async def test_routes_answer_under_every_prefix(gw: Gateway, path: str, upstream_path: str) -> None:
    """Bare, /v1 and base_url spellings of a route all reach vLLM's one path for it."""
    body, _ = BODIES[upstream_path]
    status, answer, _ = await post(gw, path, {**body, "model": "sim-model"})
    assert status == 200, answer
    assert sum(served(gw, upstream_path)) == 1


@pytest.mark.parametrize("upstream_path", sorted(BODIES))
async def test_unknown_model_gets_404_without_an_upstream_call(
    gw: Gateway, upstream_path: str
) -> None:
    """A model no instance serves is the gateway's 404 on every route: model_not_found, or
    not_found_error on Anthropic's."""
    body, _ = BODIES[upstream_path]
    status, answer, _ = await post(gw, upstream_path, {**body, "model": "nope"})
    assert status == 404
    assert is_error(upstream_path, answer, "model_not_found", "not_found_error")
    assert sum(served(gw, upstream_path)) == 0


@pytest.mark.parametrize("upstream_path", sorted(BODIES))
async def test_routes_need_the_key(gw: Gateway, upstream_path: str) -> None:
    """Without the gateway's key every route answers 401 and no instance is asked."""
    body, _ = BODIES[upstream_path]
    status, answer, _ = await post(gw, upstream_path, {**body, "model": "sim-model"}, headers={})
    assert status == 401
    assert is_error(upstream_path, answer, "invalid_api_key", "authentication_error")
    assert sum(served(gw, upstream_path)) == 0


async def test_unknown_route_404_lists_the_new_routes(gw: Gateway) -> None:
    """A path that is no route gets OpenAI's 404, whose message names the routes there are."""
    status, answer, _ = await post(gw, "/v1/nothing-here", {})
    assert status == 404
    message = answer["error"]["message"]
    for route in ROUTES:
        assert route.upstream_path in message


def client(gw: Gateway) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.base_url, api_key=KEY, max_retries=0)


async def test_responses_through_the_sdk_whole_and_streamed(gw: Gateway) -> None:
    """The SDK's Responses API works through the gateway; a stream ends on
    response.completed (no [DONE]) without an error event appended."""
    async with client(gw) as c:
        whole = await c.responses.create(model="other-model", input="hi", max_output_tokens=4)
        with structlog.testing.capture_logs() as events:
            stream = await c.responses.create(
                model="other-model", input="hi", max_output_tokens=4, stream=True
            )
            kinds = [event.type async for event in stream]
    (line,) = [e for e in events if e["event"] == "request"]
    assert line["completion_tokens"] == 4  # the usage's output_tokens, not a count of events
    assert whole.output_text.strip()
    assert kinds[0] == "response.created"
    assert kinds[-1] == "response.completed"
    assert kinds.count("response.output_text.delta") == 4
    assert gw.metrics.stream_aborts.labels("upstream")._value.get() == 0


def upload(model: str | None, audio: bytes, *, stream: bool = False) -> aiohttp.FormData:
    data = aiohttp.FormData()
    if model is not None:
        data.add_field("model", model)
    data.add_field("file", audio, filename="a.wav", content_type="audio/wav")
    if stream:
        data.add_field("stream", "true")
    return data


async def test_transcription_through_the_sdk_reaches_the_models_instance(gw: Gateway) -> None:
    """The SDK's multipart transcription is routed by its `model` form field."""
    async with client(gw) as c:
        result = await c.audio.transcriptions.create(
            model="other-model", file=("a.wav", b"RIFF" + bytes(64000), "audio/wav")
        )
    assert result.text
    assert sim_named(gw, "other-model").stats.paths["/v1/audio/transcriptions"] == 1
    assert sum(served(gw, "/v1/audio/transcriptions")) == 1


async def test_upload_reaches_the_instance_byte_for_byte(gw: Gateway) -> None:
    """The multipart body the instance gets is the client's, unchanged (boundary included)."""
    audio = bytes(range(256)) * 300 + b'\r\n--not-a-boundary\r\nname="model"\r\n\r\nnope'
    writer = upload("sim-model", audio)()
    chunks: list[bytes] = []

    class Sink:
        async def write(self, data: bytes) -> None:
            chunks.append(bytes(data))

    await writer.write(Sink())  # type: ignore[arg-type]
    raw = b"".join(chunks)
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            gw.url + "/v1/audio/translations",
            data=raw,
            headers={**AUTH, "Content-Type": writer.content_type},
        ) as r,
    ):
        assert r.status == 200, await r.text()
    sim = sim_named(gw, "sim-model")
    assert sim.stats.last_upload == hashlib.sha256(raw).hexdigest()


async def test_upload_for_an_unknown_model_gets_404_without_an_upstream_call(
    gw: Gateway,
) -> None:
    """An upload naming a model no instance serves is refused before any instance sees it."""
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            gw.url + "/v1/audio/transcriptions", data=upload("nope", b"x" * 100), headers=AUTH
        ) as r,
    ):
        assert r.status == 404
        assert (await r.json())["error"]["code"] == "model_not_found"
    assert sum(served(gw, "/v1/audio/transcriptions")) == 0


async def test_upload_streams_when_its_form_asks(gw: Gateway) -> None:
    """`stream=true` in the form is relayed as server-sent events ending in [DONE]."""
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            gw.url + "/v1/audio/transcriptions",
            data=upload("sim-model", b"x" * 64000, stream=True),
            headers=AUTH,
        ) as r,
    ):
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        text = await r.text()
    assert "transcription.chunk" in text
    assert text.endswith("data: [DONE]\n\n")
    assert '"error"' not in text


@pytest.mark.parametrize(
    ("content_type", "data"),
    [
        ("application/json", b'{"model": "sim-model"}'),
        ("multipart/form-data", b"--x\r\n"),  # no boundary parameter
        ("multipart/form-data; boundary=abc", b"--abc\r\nContent-Disposition: form-data"),
    ],
)
async def test_a_bad_upload_is_400_before_any_instance(
    gw: Gateway, content_type: str, data: bytes
) -> None:
    """JSON on an upload route, a missing boundary or a torn body get 400 from the gateway."""
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            gw.url + "/v1/audio/transcriptions",
            data=data,
            headers={**AUTH, "Content-Type": content_type},
        ) as r,
    ):
        assert r.status == 400
        assert (await r.json())["error"]["type"] == "invalid_request_error"
    assert sum(served(gw, "/v1/audio/transcriptions")) == 0


async def test_an_upload_over_max_body_bytes_is_413() -> None:
    """An upload is bounded by max_body_bytes like any body; no instance sees it."""
    async with (
        fleet(FAST) as sims,
        gateway_with(sims, sections={"gateway": {"max_body_bytes": 4096}}) as gw,
        aiohttp.ClientSession() as s,
        s.post(
            gw.url + "/v1/audio/transcriptions",
            data=upload("sim-model", b"x" * 10000),
            headers=AUTH,
        ) as r,
    ):
        assert r.status == 413
        assert sum(served(gw, "/v1/audio/transcriptions")) == 0


async def test_untimed_streams_teach_no_speed_and_count_no_ttft(gw: Gateway) -> None:
    """A Responses or transcription stream (first event before any token, or a prompt not
    counted) records no TTFT and teaches least_time nothing; a chat stream does both."""
    async with client(gw) as c:
        stream = await c.responses.create(
            model="sim-model", input="hi", max_output_tokens=4, stream=True
        )
        _ = [event async for event in stream]
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            gw.url + "/v1/audio/transcriptions",
            data=upload("sim-model", b"x" * 64000, stream=True),
            headers=AUTH,
        ) as r,
    ):
        await r.read()
    assert ttft_sum(gw, "short") == 0
    speeds = [
        (s.speed.prefill.samples, s.speed.tpot.samples)
        for s in gw.dispatcher.scheduler.instances.states
    ]
    assert speeds == [(0, 0), (0, 0)]
    async with client(gw) as c:
        chat = await c.chat.completions.create(
            model="sim-model",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            stream=True,
        )
        _ = [chunk async for chunk in chat]
    assert ttft_sum(gw, "short") > 0
    assert sum(s.speed.prefill.samples for s in gw.dispatcher.scheduler.instances.states) == 1
    assert sum(s.speed.tpot.samples for s in gw.dispatcher.scheduler.instances.states) == 1


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/rerank", {"query": "q", "documents": ["short", "d " * 10000]}),
        ("/score", {"text_1": "q", "text_2": ["d " * 10000]}),
        ("/v1/responses", {"input": [{"role": "user", "content": "d " * 10000}]}),
        ("/pooling", {"input": "d " * 10000}),
    ],
)
async def test_a_long_prompt_on_a_new_route_takes_the_long_lane(
    gw: Gateway, path: str, body: dict[str, Any]
) -> None:
    """The lane follows the estimated prompt on these routes too (here 5,000 tokens)."""
    with structlog.testing.capture_logs() as events:
        status, answer, _ = await post(gw, path, {**body, "model": "sim-model"})
    assert status == 200, answer
    (line,) = [e for e in events if e["event"] == "request"]
    assert line["lane"] == "prefill"


async def test_a_responses_stream_cut_before_its_final_event_ends_with_an_error(
    gw: Gateway,
) -> None:
    """An instance that dies mid-way through a Responses stream (no response.completed)
    leaves the client an in-band error event, as any broken stream does."""
    for sim in gw.sims:
        sim.faults.die_after_chunks = 3
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            gw.url + "/v1/responses",
            json={"model": "sim-model", "input": "hi", "max_output_tokens": 8, "stream": True},
            headers=AUTH,
        ) as r,
    ):
        assert r.status == 200
        text = await r.text()
    assert text.count("event: response.") == 3
    assert "response.completed" not in text
    assert '"error"' in text
    assert text.endswith("data: [DONE]\n\n")
    assert gw.metrics.stream_aborts.labels("upstream")._value.get() == 1


@pytest.mark.parametrize("path", ["/v1/audio/transcriptions", "/audio/translations"])
async def test_uploads_need_the_key(gw: Gateway, path: str) -> None:
    """An upload without the gateway's key is 401 and its body reaches no instance."""
    async with (
        aiohttp.ClientSession() as s,
        s.post(gw.url + path, data=upload("sim-model", b"x" * 1000)) as r,
    ):
        assert r.status == 401
    assert sum(sum(sim.stats.paths.values()) for sim in gw.sims) == 0


def ttft_sum(gw: Gateway, lane: str) -> float:
    """Seconds of TTFT observed in `lane`, over every server."""
    return sum(
        sample.value
        for metric in gw.metrics.ttft.collect()
        for sample in metric.samples
        if sample.name == "gateway_ttft_seconds_sum" and sample.labels["lane"] == lane
    )
