"""Hostile and malformed requests: each gets an OpenAI-shaped 4xx and nothing reaches an instance.

Well-formed HTTP with bad content goes through aiohttp's client; what aiohttp refuses to
send (smuggling attempts, broken header lines, oversized lines) goes over a raw socket.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import openai
import pytest
from fakes import KEY, Gateway, fleet, gateway_with

from gateway.sim.sim_vllm import SimConfig

LIMIT = 4096
CHAT = "/v1/chat/completions"
GOOD_BODY = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()


@pytest.fixture
async def gw() -> AsyncIterator[Gateway]:
    async with (
        fleet(SimConfig(instant=True)) as sims,
        gateway_with(
            sims,
            sections={
                "gateway": {"max_body_bytes": LIMIT},
                "dispatch": {"health_check_interval": 60},
            },
        ) as gw,
    ):
        yield gw


def assert_openai_error(body: bytes, code: str | None = None) -> dict[str, Any]:
    """The body is exactly OpenAI's error shape (and never carries the client's key)."""
    assert KEY.encode() not in body
    data = json.loads(body)
    assert set(data) == {"error"}, data
    error = data["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str)
    assert error["message"]
    assert isinstance(error["type"], str)
    assert error["param"] is None or isinstance(error["param"], str)
    assert error["code"] is None or isinstance(error["code"], str | int)
    if code is not None:
        assert error["code"] == code, error
    return dict(error)


def forwarded(gw: Gateway) -> int:
    return sum(s.stats.requests for s in gw.sims)


# ---------------------------------------------------------------- well-formed HTTP, bad content


@dataclass(frozen=True)
class Bad:
    status: int
    code: str
    body: bytes = GOOD_BODY
    headers: dict[str, str] = field(default_factory=dict)
    method: str = "POST"
    path: str = CHAT
    auth: str | None = f"Bearer {KEY}"
    content_type: str | None = "application/json"
    chunked: bool = False


def _deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


TOO_BIG = b'{"prompt": "' + b"x" * (LIMIT + 1) + b'"}'

BAD: dict[str, Bad] = {
    "invalid-json": Bad(400, "invalid_json", body=b'{"messages": [}'),
    "json-array": Bad(400, "invalid_json", body=b"[1, 2]"),
    "json-string": Bad(400, "invalid_json", body=b'"hello"'),
    "empty-body": Bad(400, "invalid_json", body=b""),
    "invalid-utf8": Bad(400, "invalid_json", body=b'{"prompt": "\xff\xfe"}'),
    "text-plain": Bad(400, "unsupported_content_type", content_type="text/plain"),
    "form": Bad(400, "unsupported_content_type", content_type="application/x-www-form-urlencoded"),
    "multipart": Bad(400, "unsupported_content_type", content_type="multipart/form-data; b=x"),
    "no-content-type": Bad(400, "unsupported_content_type", content_type=None),
    "over-limit-with-length": Bad(413, "request_too_large", body=TOO_BIG),
    "over-limit-chunked": Bad(413, "request_too_large", body=TOO_BIG, chunked=True),
    "tag-with-space": Bad(400, "invalid_header", headers={"X-Request-Tag": "a b"}),
    "tag-too-long": Bad(400, "invalid_header", headers={"X-Request-Tag": "t" * 65}),
    "tag-non-ascii": Bad(400, "invalid_header", headers={"X-Request-Tag": "café"}),
    "tag-with-quote": Bad(400, "invalid_header", headers={"X-Request-Tag": 'a"b'}),
    "tag-html": Bad(400, "invalid_header", headers={"X-Request-Tag": "<script>"}),
    "no-key": Bad(401, "invalid_api_key", auth=None),
    "wrong-key": Bad(401, "invalid_api_key", auth="Bearer sk-wrong"),
    "key-prefix": Bad(401, "invalid_api_key", auth=f"Bearer {KEY[:-1]}"),
    "key-extended": Bad(401, "invalid_api_key", auth=f"Bearer {KEY}x"),
    "empty-bearer": Bad(401, "invalid_api_key", auth="Bearer "),
    "basic-scheme": Bad(401, "invalid_api_key", auth="Basic c2stdGVzdDp4"),
    "key-without-scheme": Bad(401, "invalid_api_key", auth=KEY),
    "very-long-key": Bad(401, "invalid_api_key", auth="Bearer " + "k" * 8000),
    "unknown-route": Bad(404, "not_found", path="/v1/nope"),
    "wrong-method": Bad(405, "method_not_allowed", method="GET"),
    "models-without-key": Bad(401, "invalid_api_key", method="GET", path="/v1/models", auth=None),
    "admin-without-key": Bad(
        401, "invalid_api_key", method="GET", path="/admin/instances", auth=None
    ),
}


async def _chunks(data: bytes) -> AsyncIterator[bytes]:
    for start in range(0, len(data), 1024):
        yield data[start : start + 1024]


async def send(gw: Gateway, bad: Bad) -> tuple[int, dict[str, str], bytes]:
    headers = dict(bad.headers)
    if bad.auth is not None:
        headers["Authorization"] = bad.auth
    if bad.content_type is not None:
        headers["Content-Type"] = bad.content_type
    data: Any = _chunks(bad.body) if bad.chunked else bad.body
    async with (
        aiohttp.ClientSession(skip_auto_headers=["Content-Type"]) as s,
        s.request(bad.method, gw.url + bad.path, data=data, headers=headers) as resp,
    ):
        return resp.status, dict(resp.headers), await resp.read()


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
async def test_bad_request_gets_an_openai_4xx_and_reaches_no_instance(
    gw: Gateway, case: str
) -> None:
    """Each bad request gets its OpenAI-shaped 4xx and never reaches an instance."""
    bad = BAD[case]
    status, _, body = await send(gw, bad)
    assert status == bad.status, body
    error = assert_openai_error(body, bad.code)
    if bad.code == "invalid_header":
        assert error["param"] == "X-Request-Tag"
    assert forwarded(gw) == 0


async def test_wrong_key_is_an_authentication_error_in_the_sdk(gw: Gateway) -> None:
    """The SDK raises AuthenticationError with code invalid_api_key for a wrong key."""
    async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="sk-nope", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError) as info:
            await c.chat.completions.create(
                model="sim-model", messages=[{"role": "user", "content": "x"}]
            )
    assert info.value.code == "invalid_api_key"
    assert "sk-nope" not in info.value.message
    assert forwarded(gw) == 0


async def test_deeply_nested_json_gets_400_not_500(gw: Gateway) -> None:
    """A body nested past the JSON parser's recursion limit gets 400 invalid_json, not a 500."""
    status, _, body = await send(gw, Bad(400, "invalid_json", body=_deep(2000)))
    assert status == 400
    assert_openai_error(body, "invalid_json")
    assert forwarded(gw) == 0


@pytest.mark.parametrize("field", ["prompt", "input"])
async def test_deeply_nested_prompt_is_never_a_500(gw: Gateway, field: str) -> None:
    """A valid JSON body with a deeply nested prompt never makes the gateway answer 5xx."""
    body = b'{"' + field.encode() + b'": ' + _deep(900) + b"}"
    status, _, answer = await send(gw, Bad(400, "", body=body, path="/v1/completions"))
    assert status < 500, answer
    assert_openai_error(answer)


@pytest.mark.parametrize("prompt", [[1, 2**40], [1, "x"], [1, None], [7, [8]]])
async def test_odd_token_id_prompt_goes_to_the_instance_not_a_500(
    gw: Gateway, prompt: list[object]
) -> None:
    """Token ids out of range or not ints are the instance's to judge: never a 500 here."""
    body = json.dumps({"prompt": prompt, "max_tokens": 1}).encode()
    status, _, answer = await send(gw, Bad(400, "", body=body, path="/v1/completions"))
    assert status < 500, answer
    assert forwarded(gw) == 1


# ---------------------------------------------------------------- what aiohttp will not send


async def raw_exchange(gw: Gateway, data: bytes, timeout: float = 5.0) -> tuple[int, bytes, bytes]:
    """Write raw bytes; return the status, the header block and the body of the answer."""
    host, port = gw.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(timeout):
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            length = next(
                (
                    int(v)
                    for k, _, v in (ln.partition(b":") for ln in lines[1:])
                    if k.strip().lower() == b"content-length"
                ),
                0,
            )
            body = await reader.readexactly(length)
    finally:
        writer.close()
    return int(lines[0].split()[1]), head, body


def request(*extra: bytes, body: bytes = GOOD_BODY, length: bool = True) -> bytes:
    head = [
        b"POST /v1/chat/completions HTTP/1.1",
        b"Host: 127.0.0.1",
        b"Content-Type: application/json",
        b"Authorization: Bearer " + KEY.encode(),
        *extra,
    ]
    if length:
        head.append(b"Content-Length: %d" % len(body))
    return b"\r\n".join(head) + b"\r\n\r\n" + body


MALFORMED: dict[str, bytes] = {
    "content-length-and-chunked": request(b"Transfer-Encoding: chunked"),
    "two-content-lengths": request(b"Content-Length: 3"),
    "content-length-not-a-number": request(b"Content-Length: abc", length=False),
    "negative-content-length": request(b"Content-Length: -5", length=False),
    "nul-in-header": request(b"X-Foo: a\x00b"),
    "header-without-colon": request(b"XFoo"),
    "space-before-colon": request(b"X-Foo : a"),
    "obsolete-line-folding": request(b"X-Foo: a", b" folded"),
    "header-over-8k": request(b"X-Big: " + b"a" * 9000),
    "key-over-8k": request(b"Authorization: Bearer " + b"k" * 9000),
    "too-many-headers": request(*(b"X-H%d: v" % i for i in range(200))),
    "url-over-8k": b"POST /v1/" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    "garbage-request-line": b"GARBAGE\r\n\r\n",
    "bad-chunk-size": request(
        b"Transfer-Encoding: chunked", body=b"zz\r\nabc\r\n0\r\n\r\n", length=False
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED), ids=list(MALFORMED))
async def test_malformed_http_gets_a_4xx_and_reaches_no_instance(gw: Gateway, case: str) -> None:
    """Malformed HTTP (smuggling, broken or huge header lines) gets a 4xx, never forwarded."""
    status, _, _ = await raw_exchange(gw, MALFORMED[case])
    assert 400 <= status < 500
    assert forwarded(gw) == 0


@pytest.mark.parametrize("case", list(MALFORMED), ids=list(MALFORMED))
async def test_malformed_http_error_has_the_openai_shape(gw: Gateway, case: str) -> None:
    """Even an answer to malformed HTTP carries OpenAI's error shape."""
    _, head, body = await raw_exchange(gw, MALFORMED[case])
    assert b"application/json" in head.lower()
    assert_openai_error(body)


async def test_huge_declared_length_is_refused_at_once(gw: Gateway) -> None:
    """A Content-Length over the limit gets 413 at once, without waiting for the body to arrive."""
    started = time.monotonic()
    status, _, body = await raw_exchange(
        gw, request(b"Content-Length: 1000000000", body=b"", length=False)
    )
    assert time.monotonic() - started < 1.0
    assert status == 413
    assert_openai_error(body, "request_too_large")
    assert forwarded(gw) == 0


# ---------------------------------------------------------------- what reaches an instance

HOP_BY_HOP = {
    "connection": "keep-alive, X-Hop-Secret",
    "x-hop-secret": "listed-in-connection",
    "keep-alive": "timeout=5, max=100",
    "te": "trailers",
    "trailer": "X-Checksum",
    "upgrade": "h2c",
    "proxy-authorization": "Basic c2VjcmV0OnNlY3JldA==",
    "proxy-connection": "keep-alive",
}


async def test_hop_by_hop_headers_and_the_client_key_never_reach_the_instance(
    gw: Gateway,
) -> None:
    """Hop-by-hop headers, those Connection names, and the client's key stay at the gateway."""
    extra = [f"{k}: {v}".encode() for k, v in HOP_BY_HOP.items()]
    body = GOOD_BODY
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    status, _, answer = await raw_exchange(
        gw, request(*extra, b"Transfer-Encoding: chunked", body=chunked, length=False)
    )
    assert status == 200, answer
    seen = gw.sims[0].stats.last_headers
    assert forwarded(gw) == 1
    for name, sent in HOP_BY_HOP.items():
        assert seen.get(name) != sent, name
    for name in ("x-hop-secret", "keep-alive", "te", "trailer", "upgrade", "proxy-authorization"):
        assert name not in seen, name
    assert "proxy-connection" not in seen
    assert "chunked" not in seen.get("transfer-encoding", "")
    assert "authorization" not in seen
    assert all(KEY not in v for v in seen.values())


async def test_instance_gets_its_own_key_never_the_clients(monkeypatch: pytest.MonkeyPatch) -> None:
    """An instance with api_key_env receives its own key; the client's key is never forwarded."""
    monkeypatch.setenv("SIM_INSTANCE_KEY", "sk-instance-own")
    async with (
        fleet(SimConfig(instant=True, api_key="sk-instance-own")) as sims,
        gateway_with(
            sims,
            instances=[{"url": sims[0].url, "api_key_env": "SIM_INSTANCE_KEY"}],
        ) as gw,
    ):
        async with openai.AsyncOpenAI(base_url=gw.base_url, api_key=KEY, max_retries=0) as c:
            answer = await c.chat.completions.create(
                model="sim-model", messages=[{"role": "user", "content": "x"}], max_tokens=2
            )
        assert answer.choices
        assert sims[0].stats.last_headers["authorization"] == "Bearer sk-instance-own"
        assert all(KEY not in v for v in sims[0].stats.last_headers.values())
