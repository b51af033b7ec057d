"""Migration's pure parts: which requests a continuation can reproduce, what the first part
sent, the continuation's request, and its events as the client sees them."""

from __future__ import annotations

import orjson
import pytest

from gateway.relay.continuation import (
    COMPACT_EVERY,
    Rewriter,
    Sent,
    Transcript,
    continuation_body,
    refusal,
)
from gateway.routes import CHAT, COMPLETIONS, MESSAGES, Route

CHAT_BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}


def chunk(content: str | None = None, *, role: str | None = None, finish: str | None = None,
          id_: str = "chatcmpl-a", created: int = 100) -> bytes:  # fmt: skip
    delta: dict[str, object] = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    body = {"id": id_, "object": "chat.completion.chunk", "created": created, "model": "m",
            "choices": [choice]}  # fmt: skip
    return b"data: " + orjson.dumps(body) + b"\n\n"


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ({"n": 2}, "n"),
        ({"best_of": 3}, "best_of"),
        ({"logprobs": True}, "logprobs"),
        ({"top_logprobs": 2}, "logprobs"),
        ({"seed": 0}, "seed"),
        ({"response_format": {"type": "json_object"}}, "structured_output"),
        ({"guided_json": {}}, "structured_output"),
        ({"structured_outputs": {"regex": "a+"}}, "structured_output"),
        ({"n": 1, "seed": None, "logprobs": False}, None),
    ],
)
def test_what_a_continuation_cannot_reproduce(extra: dict[str, object], why: str | None) -> None:
    assert refusal(CHAT, {**CHAT_BODY, **extra}) == why


def test_routes_and_prompts_a_continuation_cannot_extend() -> None:
    assert refusal(MESSAGES, {"messages": []}) == "route"
    assert refusal(COMPLETIONS, {"prompt": "a"}) is None
    assert refusal(COMPLETIONS, {"prompt": ["a", "b"]}) == "prompt"
    assert refusal(COMPLETIONS, {"prompt": "a", "echo": True}) == "echo"


def transcript(*events: bytes, route: Route = CHAT) -> Transcript:
    kept = Transcript(route)
    for event in events:
        kept.add(event)
    return kept


def test_what_the_first_part_sent() -> None:
    """The text as the client read it (JSON escapes undone), one token a chunk, the first
    event's id, created and model."""
    events = [chunk(role="assistant", content=""), chunk('He said "hi"'), chunk(" \u00e9\n")]
    kept = transcript(*events)
    assert kept.sent() == Sent(b"chatcmpl-a", b"100", b"m", 'He said "hi" \u00e9\n', 2)
    assert len(kept.text) < sum(len(e) for e in events) / 5  # compact
    tool = b'data: {"id":"x","created":1,"model":"m","choices":[{"delta":{"tool_calls":[{}]}}]}'
    assert transcript(*events, tool).sent().tool_call  # type: ignore[union-attr]
    thinking = chunk().replace(b'"delta":{}', b'"delta":{"reasoning_content":"hmm"}')
    assert transcript(*events, thinking).sent().reasoning  # type: ignore[union-attr]
    done = transcript(*events, chunk(finish="stop")).sent()
    assert done is not None
    assert done.finished
    assert transcript().sent() is None  # nothing sent
    lost = transcript(*events)
    lost.lose()
    assert lost.sent() is None


def test_a_completions_transcript_reads_the_text() -> None:
    event = (
        b'data: {"id":"cmpl-1","object":"text_completion","created":7,"model":"m",'
        b'"choices":[{"index":0,"text":" upon","logprobs":null,"finish_reason":null}]}'
    )
    sent = transcript(event, event, route=COMPLETIONS).sent()
    assert sent == Sent(b"cmpl-1", b"7", b"m", " upon upon", 2)


def test_the_continuation_asks_for_the_rest_of_the_answer() -> None:
    sent = Sent(b"chatcmpl-a", b"100", b"m", "Hello there", 2, False, False)
    body = continuation_body(CHAT, {**CHAT_BODY, "min_tokens": 5, "stream": True}, sent)
    assert body is not None
    assert body["messages"][-1] == {"role": "assistant", "content": "Hello there"}
    assert body["messages"][:-1] == CHAT_BODY["messages"]
    assert (body["continue_final_message"], body["add_generation_prompt"]) == (True, False)
    assert (body["max_tokens"], body["min_tokens"]) == (18, 3)
    assert body["stream_options"] == {"include_usage": True}
    done = Sent(b"a", b"1", b"m", "x" * 20, 20, False, False)
    assert continuation_body(CHAT, CHAT_BODY, done) is None  # no token left
    plain = continuation_body(COMPLETIONS, {"prompt": "Once", "max_tokens": 9}, sent)
    assert plain is not None
    assert (plain["prompt"], plain["max_tokens"]) == ("OnceHello there", 7)


def test_the_continuations_events_join_the_first_parts_stream() -> None:
    first = Sent(b"chatcmpl-a", b"100", b"m", "Hello", 1, False, False)
    rewrite = Rewriter(first, CHAT, client_usage=True, before=1)
    role = chunk(role="assistant", content="", id_="chatcmpl-b", created=200)
    token = chunk(" world", id_="chatcmpl-b", created=200)
    assert rewrite.event(role.rstrip(b"\n")) == b""  # the client had its role chunk
    assert rewrite.event(token.rstrip(b"\n")) == chunk(" world").rstrip(b"\n")
    usage = (
        b'data: {"id":"chatcmpl-b","object":"chat.completion.chunk","created":200,'
        b'"model":"m","choices":[],"usage":{"prompt_tokens":14,"total_tokens":19,'
        b'"completion_tokens":5}}'
    )
    assert rewrite.event(usage) == (
        b'data: {"id":"chatcmpl-a","object":"chat.completion.chunk","created":100,'
        b'"model":"m","choices":[],"usage":{"prompt_tokens":13,"total_tokens":19,'
        b'"completion_tokens":6}}'
    )
    assert rewrite.event(b"data: [DONE]") == b"data: [DONE]"
    hidden = Rewriter(first, CHAT, client_usage=False, before=1)
    assert hidden.feed(token + usage + b"\n\n" + b"data: [DONE]\n\n") == (
        chunk(" world") + b"data: [DONE]\n\n"
    )


def test_a_long_stream_is_boiled_down_as_it_goes() -> None:
    """At most COMPACT_EVERY whole events are held; the text comes out the same."""
    kept = Transcript(CHAT)
    kept.add(chunk(role="assistant", content=""))
    for i in range(1000):
        kept.add(chunk(f" w{i}", id_="chatcmpl-z", created=5))
        assert len(kept.raw) < COMPACT_EVERY
    sent = kept.sent()
    assert sent is not None
    assert (sent.id, sent.created, sent.tokens) == (b"chatcmpl-a", b"100", 1000)
    assert sent.text == "".join(f" w{i}" for i in range(1000))
