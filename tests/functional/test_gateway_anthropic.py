"""The gateway through the real Anthropic SDK, in front of simulated vLLM instances serving
Anthropic's Messages API as vLLM does."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anthropic
import pytest
import structlog
from fakes import KEY, Gateway, fleet, gateway_with
from prometheus_client.parser import text_string_to_metric_families

from gateway.sim.sim_vllm import SimConfig

FAST = SimConfig(decode_s_per_token=0.001, prefill_tokens_per_s=1e6)
HELLO = [{"role": "user", "content": "hello there"}]

# What Claude Code sends (abridged): the system prompt as text blocks with cache_control,
# tools with an input_schema, and a turn of tool_use and tool_result.
CLAUDE_CODE_BODY = {
    "model": "sim-model",
    "max_tokens": 6,
    "stream": True,
    "system": [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.0; cch=1f2e3d;"},
        {
            "type": "text",
            "text": "You are Claude Code, a CLI for coding.",
            "cache_control": {"type": "ephemeral"},
        },
    ],
    "tools": [
        {
            "name": "Read",
            "description": "Reads a file from the local filesystem.",
            "input_schema": {
                "type": "object",
                "properties": {"file_path": {"type": "string"}},
                "required": ["file_path"],
                "additionalProperties": False,
                "$schema": "http://json-schema.org/draft-07/schema#",
            },
        }
    ],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "What is in main.py?"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me read it."},
                {
                    "type": "tool_use",
                    "id": "toolu_01A",
                    "name": "Read",
                    "input": {"file_path": "/src/main.py"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_01A",
                    "content": "print('hi')\n",
                    "cache_control": {"type": "ephemeral"},
                }
            ],
        },
    ],
    "metadata": {"user_id": "user_abc_account__session_123"},
    "temperature": 1,
}
CLAUDE_CODE_HEADERS = {
    "anthropic-version": "2023-06-01",
    "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
    "x-app": "cli",
    "User-Agent": "claude-cli/2.0.0 (external, cli)",
    "Content-Type": "application/json",
}


@pytest.fixture
async def gw() -> AsyncIterator[Gateway]:
    async with (
        fleet(FAST, FAST) as sims,
        gateway_with(sims, sections={"gateway": {"base_url": "http://127.0.0.1:1/api"}}) as gw,
    ):
        yield gw


def client(gw: Gateway, **kw: Any) -> anthropic.AsyncAnthropic:
    """The Anthropic SDK pointed at the gateway, without retries so errors surface at once."""
    kw.setdefault("api_key", KEY)
    return anthropic.AsyncAnthropic(base_url=gw.url, max_retries=0, **kw)


def served(gw: Gateway, path: str = "/v1/messages") -> int:
    return sum(s.stats.paths[path] for s in gw.sims)


async def test_sync_client_gets_a_whole_message_with_usage(gw: Gateway) -> None:
    """The sync SDK gets a whole message: text, the stop reason and usage in and out."""

    def run() -> anthropic.types.Message:
        with anthropic.Anthropic(base_url=gw.url, api_key=KEY, max_retries=0) as c:
            return c.messages.create(
                model="sim-model", max_tokens=5, system="Be brief.", messages=HELLO
            )

    message = await asyncio.to_thread(run)
    assert message.content[0].type == "text"
    assert message.content[0].text
    assert (message.stop_reason, message.usage.output_tokens) == ("max_tokens", 5)
    assert message.usage.input_tokens > 0


async def test_async_stream_arrives_as_anthropics_named_events(gw: Gateway) -> None:
    """A streamed answer is Anthropic's event sequence, one delta a token, usage at the end."""
    async with client(gw) as c:
        stream = await c.messages.create(
            model="sim-model", max_tokens=4, messages=HELLO, stream=True
        )
        events = [event async for event in stream]
    kinds = [e.type for e in events]
    assert kinds == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * 4,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    delta = events[-2]
    assert delta.type == "message_delta"
    assert (delta.delta.stop_reason, delta.usage.output_tokens) == ("max_tokens", 4)


async def test_the_stream_helpers_give_the_text_and_the_final_message(gw: Gateway) -> None:
    """`messages.stream`, async and sync, yields the text and a final message with usage."""
    async with (
        client(gw) as c,
        c.messages.stream(model="sim-model", max_tokens=6, messages=HELLO) as stream,
    ):
        texts = [text async for text in stream.text_stream]
        final = await stream.get_final_message()
    assert len(texts) == 6
    assert final.content[0].type == "text"
    assert final.content[0].text == "".join(texts)
    assert final.usage.output_tokens == 6

    def run() -> anthropic.types.Message:
        with (
            anthropic.Anthropic(base_url=gw.url + "/api", api_key=KEY, max_retries=0) as c,
            c.messages.stream(model="sim-model", max_tokens=3, messages=HELLO) as stream,
        ):
            return stream.get_final_message()

    message = await asyncio.to_thread(run)  # under base_url's path too
    assert message.usage.output_tokens == 3


async def test_count_tokens_is_routed_to_an_instance(gw: Gateway) -> None:
    """messages.count_tokens reaches an instance serving the model and comes back whole."""
    async with client(gw) as c:
        counted = await c.messages.count_tokens(
            model="sim-model", system="Be brief.", messages=HELLO
        )
        answer = await c.messages.create(
            model="sim-model", max_tokens=1, system="Be brief.", messages=HELLO
        )
    assert counted.input_tokens == answer.usage.input_tokens > 0
    assert served(gw, "/v1/messages/count_tokens") == 1


# ---------------------------------------------------------------- errors in Anthropic's shape


def anthropic_error(exc: anthropic.APIStatusError, kind: str) -> bool:
    body = exc.body
    return (
        isinstance(body, dict)
        and body["type"] == "error"
        and set(body["error"]) == {"type", "message"}
        and body["error"]["type"] == kind
    )


async def test_a_wrong_key_is_an_authentication_error(gw: Gateway) -> None:
    """A wrong key, as x-api-key or Bearer, is a 401 authentication_error; nothing goes on."""
    for credentials in ({"api_key": "sk-wrong"}, {"api_key": None, "auth_token": "sk-wrong"}):
        async with client(gw, **credentials) as c:
            with pytest.raises(anthropic.AuthenticationError) as info:
                await c.messages.create(model="sim-model", max_tokens=1, messages=HELLO)
        assert anthropic_error(info.value, "authentication_error")
        assert "sk-wrong" not in str(info.value)
    assert all(s.stats.requests == 0 for s in gw.sims)


async def test_the_sdk_does_not_retry_a_wrong_key(gw: Gateway) -> None:
    """With its default retries the Anthropic SDK sends a wrong key once: the 401 says
    `x-should-retry: false` (Claude Code retried one for two minutes without it)."""
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key="sk-wrong", max_retries=2) as c:
        with pytest.raises(anthropic.AuthenticationError) as info:
            await c.messages.create(model="sim-model", max_tokens=1, messages=HELLO)
    assert info.value.response.headers["x-should-retry"] == "false"
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as resp:
        text = await resp.text()
    refused = [
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "gateway_requests_total"
        and sample.labels.get("route") == "messages"
        and sample.labels.get("status") == "401"
    ]
    assert sum(refused) == 1


async def test_an_unknown_model_is_not_found(gw: Gateway) -> None:
    """A model no instance serves is the gateway's 404 not_found_error."""
    async with client(gw) as c:
        with pytest.raises(anthropic.NotFoundError) as info:
            await c.messages.create(model="claude-opus-9", max_tokens=1, messages=HELLO)
    assert anthropic_error(info.value, "not_found_error")
    assert "claude-opus-9" in info.value.message
    assert served(gw) == 0


async def test_bad_requests_are_bad_request_errors(gw: Gateway) -> None:
    """The gateway's 400 (a bad tag) is an invalid_request_error; the instance's own 400 (a
    field vLLM refuses) passes on as vLLM wrote it; the SDK raises BadRequestError for both."""
    async with client(gw) as c:
        with pytest.raises(anthropic.BadRequestError) as ours:
            await c.messages.create(
                model="sim-model",
                max_tokens=1,
                messages=HELLO,
                extra_headers={"X-Request-Tag": "not a tag!"},
            )
        with pytest.raises(anthropic.BadRequestError) as theirs:
            await c.messages.create(model="sim-model", max_tokens=0, messages=HELLO)
    assert anthropic_error(ours.value, "invalid_request_error")
    assert isinstance(theirs.value.body, dict)
    assert theirs.value.body["error"]["param"] == "body.max_tokens"  # FastAPI's handler's


async def test_a_full_gateway_is_a_rate_limit_error_with_retry_after() -> None:
    """With the instance and the gateway queue full, the next message is a 429
    rate_limit_error with Retry-After, which the SDK raises as RateLimitError."""
    slow = SimConfig(decode_s_per_token=0.05, prefill_tokens_per_s=1e6)
    async with (
        fleet(slow) as sims,
        gateway_with(
            sims,
            instances=[{"url": sims[0].url, "max_num_seqs": 1}],
            sections={"dispatch": {"max_queue_per_instance": 0, "gateway_queue_size": 1}},
        ) as gw,
        client(gw) as c,
    ):
        running = asyncio.create_task(
            c.messages.create(model="sim-model", max_tokens=15, messages=HELLO)
        )
        await until(lambda: gw.dispatcher.snapshot().inflight == 1)
        queued = asyncio.create_task(
            c.messages.create(model="sim-model", max_tokens=1, messages=HELLO)
        )
        await until(lambda: sum(gw.dispatcher.snapshot().queues.values()) == 1)
        with pytest.raises(anthropic.RateLimitError) as info:
            await c.messages.create(model="sim-model", max_tokens=1, messages=HELLO)
        await asyncio.gather(running, queued)
    assert anthropic_error(info.value, "rate_limit_error")
    assert int(info.value.response.headers["Retry-After"]) >= 1
    assert float(info.value.response.headers["retry-after-ms"]) > 0


async def test_no_instance_is_an_overloaded_503_with_retry_after() -> None:
    """With its only instance gone, the gateway's 503 is an overloaded_error with
    Retry-After; the SDK raises ServiceUnavailableError, an InternalServerError."""
    async with fleet(FAST) as sims, gateway_with(sims) as gw, client(gw) as c:
        await sims[0].stop()
        with pytest.raises(anthropic.ServiceUnavailableError) as info:
            await c.messages.create(model="sim-model", max_tokens=1, messages=HELLO)
    assert isinstance(info.value, anthropic.InternalServerError)
    assert anthropic_error(info.value, "overloaded_error")
    assert int(info.value.response.headers["Retry-After"]) >= 1


async def test_a_stream_cut_by_the_instance_ends_in_an_anthropic_error_event(
    gw: Gateway,
) -> None:
    """An instance that dies mid-stream: the client gets an `error` event (api_error), no
    `[DONE]`, and the SDK raises it."""
    for sim in gw.sims:
        sim.faults.die_after_chunks = 4  # message_start, block start and two deltas
    async with client(gw) as c:
        stream = await c.messages.create(
            model="sim-model", max_tokens=8, messages=HELLO, stream=True
        )
        seen: list[str] = []
        with pytest.raises(anthropic.APIStatusError) as info:
            await kinds_of(stream, seen)
    assert seen == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
    ]
    assert anthropic_error(info.value, "api_error")
    assert "incomplete" in info.value.body["error"]["message"]  # type: ignore[index]
    body = {**CLAUDE_CODE_BODY, "max_tokens": 8}
    async with (
        aiohttp.ClientSession() as s,
        s.post(gw.url + "/v1/messages", json=body, headers={"x-api-key": KEY}) as resp,
    ):
        raw = await resp.read()
    assert raw.endswith(b"\n\n")
    last = raw.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
    assert last.startswith(b"event: error\ndata: ")
    assert json.loads(last.split(b"data: ", 1)[1])["error"]["type"] == "api_error"
    assert b"[DONE]" not in raw


@pytest.mark.parametrize(
    ("path", "method", "status"),
    [
        ("/v1/messages", "POST", 404),
        ("/v1/messages", "GET", 405),
        ("/v1/chat/completions", "POST", 404),
    ],
)
async def test_only_the_messages_routes_answer_in_anthropics_shape(
    gw: Gateway, path: str, method: str, status: int
) -> None:
    """The Messages routes' errors, aiohttp's 405 included, are Anthropic's; an OpenAI
    route's stay OpenAI's."""
    body = {"model": "unknown-model", "max_tokens": 1, "messages": HELLO}
    headers = {"Authorization": f"Bearer {KEY}"}
    async with (
        aiohttp.ClientSession() as s,
        s.request(method, gw.url + path, json=body, headers=headers) as resp,
    ):
        answer = await resp.json()
    assert resp.status == status
    if path == "/v1/messages":
        assert answer["type"] == "error"
        assert answer["error"]["type"] == (
            "not_found_error" if status == 404 else "invalid_request_error"
        )
    else:
        assert set(answer["error"]) == {"message", "type", "param", "code"}


# ---------------------------------------------------------------- what reaches the instance


@pytest.mark.parametrize("credential", ["x-api-key", "Authorization"])
async def test_a_claude_code_request_goes_on_byte_for_byte_without_the_clients_key(
    monkeypatch: pytest.MonkeyPatch, credential: str
) -> None:
    """Claude Code's request (system blocks with cache_control, tools, a tool turn), keyed
    by x-api-key or Bearer, reaches the instance byte for byte with the instance's own key;
    the client's key and the anthropic-* headers stay behind."""
    monkeypatch.setenv("SIM_INSTANCE_KEY", "sk-instance-own")
    raw = json.dumps(CLAUDE_CODE_BODY, indent=1).encode()  # spaced as no parser would
    key = {"x-api-key": KEY} if credential == "x-api-key" else {"Authorization": f"Bearer {KEY}"}
    async with (
        fleet(SimConfig(instant=True, api_key="sk-instance-own")) as sims,
        gateway_with(
            sims, instances=[{"url": sims[0].url, "api_key_env": "SIM_INSTANCE_KEY"}]
        ) as gw,
        aiohttp.ClientSession() as s,
        s.post(
            gw.url + "/v1/messages?beta=true", data=raw, headers={**CLAUDE_CODE_HEADERS, **key}
        ) as resp,
    ):
        streamed = await resp.read()
        seen = sims[0].stats.last_headers
        assert sims[0].stats.last_body == raw
    assert resp.status == 200
    assert streamed.count(b"event: content_block_delta\n") == 6
    assert seen["authorization"] == "Bearer sk-instance-own"
    for name in ("x-api-key", "anthropic-version", "anthropic-beta", "x-app"):
        assert name not in seen, name
    assert all(KEY not in value for value in seen.values())


async def test_a_messages_request_is_never_split_in_a_prefill_decode_fleet() -> None:
    """With prefill instances in the fleet, a long Messages prompt is still served whole by
    a decode instance: disaggregation is for chat and completions only."""
    sections = {"prefill": {"long_input_threshold": 100}}
    async with fleet(FAST, FAST) as sims:
        instances = [
            {"url": sims[0].url, "name": "p", "role": "prefill"},
            {"url": sims[1].url, "name": "d", "role": "decode"},
        ]
        async with (
            gateway_with(sims, instances=instances, sections=sections) as gw,
            client(gw) as c,
        ):
            await until(
                lambda: all(
                    s.available(gw.dispatcher.clock())
                    for s in gw.dispatcher.scheduler.instances.states
                )
            )
            long = [{"role": "user", "content": "tell me more " * 200}]
            message = await c.messages.create(model="sim-model", max_tokens=3, messages=long)
    assert message.usage.output_tokens == 3
    assert (sims[0].stats.requests, sims[1].stats.requests) == (0, 1)


# ---------------------------------------------------------------- what the gateway records


async def test_a_streamed_messages_answer_records_its_ttft_and_output_tokens(gw: Gateway) -> None:
    """A streamed answer's access line has its TTFT and the output tokens of its usage, and
    its TTFT and TPOT reach the metrics; a whole answer's line has its output tokens."""
    with structlog.testing.capture_logs() as events:
        async with client(gw) as c:
            stream = await c.messages.create(
                model="sim-model", max_tokens=7, messages=HELLO, stream=True
            )
            [_ async for _ in stream]
            await c.messages.create(model="sim-model", max_tokens=2, messages=HELLO)
    streamed, whole = [e for e in events if e["event"] == "request"]
    assert (streamed["route"], streamed["status"], streamed["model"]) == (
        "messages",
        200,
        "sim-model",
    )
    assert streamed["completion_tokens"] == 7
    assert 0 < streamed["ttft_ms"] <= streamed["duration_ms"]
    assert streamed["prompt_tokens"] > 0
    assert (whole["completion_tokens"], whole["ttft_ms"]) == (2, None)
    server = streamed["server"]
    assert await metric(gw, "gateway_ttft_seconds_count", server=server, lane="short") == 1
    assert await metric(gw, "gateway_tpot_seconds_count", server=server, lane="short") == 1
    assert await metric(gw, "gateway_requests_total", route="messages", status="200") == 2


async def kinds_of(stream: AsyncIterator[Any], seen: list[str]) -> None:
    """Note each event's type in `seen` as it arrives, until the stream ends or raises."""
    async for event in stream:
        seen.append(event.type)


async def until(predicate: Any, timeout: float = 5.0) -> None:
    """Wait until predicate() holds, failing after timeout seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def metric(gw: Gateway, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels`."""
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as resp:
        text = await resp.text()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


async def test_a_clients_kv_transfer_params_never_reach_an_instance(gw: Gateway) -> None:
    """vLLM's Messages handler copies kv_transfer_params into its chat request, where they
    name hosts and KV blocks: refused with a 400 in Anthropic's shape, in a fleet without
    roles too, and on the OpenAI routes in theirs."""
    params = {"do_remote_prefill": True, "remote_host": "10.0.0.1", "remote_block_ids": [1]}
    async with client(gw) as c:
        with pytest.raises(anthropic.BadRequestError) as refused:
            await c.messages.create(
                model="sim-model",
                max_tokens=1,
                messages=HELLO,
                extra_body={"kv_transfer_params": params},
            )
    assert anthropic_error(refused.value, "invalid_request_error")
    assert "kv_transfer_params" in str(refused.value)
    headers = {"Authorization": f"Bearer {KEY}"}
    chat = {"model": "sim-model", "messages": HELLO, "max_tokens": 1}
    prompt = {"model": "sim-model", "prompt": "hi", "max_tokens": 1}
    async with aiohttp.ClientSession(headers=headers) as s:
        for path, body in (("/v1/chat/completions", chat), ("/v1/completions", prompt)):
            async with s.post(gw.url + path, json={**body, "kv_transfer_params": params}) as r:
                assert r.status == 400, path
                error = (await r.json())["error"]
                assert error["param"] == "kv_transfer_params", path
    assert sum(s.stats.requests for s in gw.sims) == 0


@pytest.mark.parametrize("role", ["user", "assistant"])
async def test_a_body_nested_past_the_stack_is_a_bad_request(gw: Gateway, role: str) -> None:
    """A tool_result nested 990 deep (which the parser still takes) is refused with a 400
    in Anthropic's shape, never the gateway's own 500."""
    block = {"type": "tool_result", "tool_use_id": "t", "content": "NESTED"}
    message = {"role": role, "content": [block]}
    body = json.dumps({"model": "sim-model", "max_tokens": 1, "messages": [message]})
    body = body.replace('"NESTED"', "[" * 990 + '"x"' + "]" * 990)  # json.dumps would recurse
    headers = {"x-api-key": KEY, "content-type": "application/json"}
    async with (
        aiohttp.ClientSession() as s,
        s.post(gw.url + "/v1/messages", data=body, headers=headers) as r,
    ):
        assert r.status == 400
        answer = await r.json()
    assert answer["type"] == "error"
    assert answer["error"]["type"] == "invalid_request_error"
    assert "nested" in answer["error"]["message"]
