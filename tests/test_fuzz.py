"""Hypothesis fuzz of the request path and of the pure pieces it leans on.

Against a gateway running in-process (two instant simulated instances): random bodies,
content types, routes and header values never get a 5xx, every 4xx has OpenAI's error
shape, and nothing is forwarded when the key is wrong. Without a server: `KeyChecker.check`
and `estimate_request` never raise, whatever they are given.
"""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from fakes import KEY, Gateway, fleet, gateway_with
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.proxy.auth import KeyChecker
from gateway.proxy.tokens import estimate_request
from gateway.sim.sim_vllm import SimConfig

LIMIT = 4096

# ---------------------------------------------------------------- strategies

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5)
    ),
    max_leaves=20,
)
# Fields an OpenAI body has, with values of any JSON type, so the fuzz reaches deep code.
FIELDS = [
    "model", "messages", "prompt", "input", "stream", "stream_options", "max_tokens", "tools",
    "documents",
]  # fmt: skip
messages = st.lists(
    st.fixed_dictionaries(
        {},
        optional={
            "role": st.sampled_from(["user", "system", "assistant"]) | json_values,
            "content": st.text(max_size=60)
            | st.lists(
                st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)})
                | st.fixed_dictionaries(
                    {"type": st.sampled_from(["image_url", "input_audio", "video_url"])},
                    optional={"image_url": json_values},
                )
                | json_values,
                max_size=3,
            )
            | json_values,
        },
    )
    | json_values,
    max_size=4,
)
openai_like = st.fixed_dictionaries(
    {},
    optional={
        "model": st.just("sim-model") | json_values,
        "messages": messages,
        "prompt": st.text(max_size=60) | st.lists(st.integers(0, 50000), max_size=8) | json_values,
        "input": st.text(max_size=60) | st.lists(st.text(max_size=10), max_size=3) | json_values,
        "stream": st.booleans() | json_values,
        "stream_options": st.just({"include_usage": True}) | json_values,
        "max_tokens": st.integers(-2, 8) | json_values,
        "tools": st.lists(json_values, max_size=2) | json_values,
    },
)
json_like_dicts = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), json_values)
bodies = (
    openai_like.map(lambda d: json.dumps(d).encode())
    | json_values.map(lambda v: json.dumps(v).encode())
    | st.binary(max_size=200)
    | st.text(max_size=100).map(str.encode)
    | st.just(b"x" * (LIMIT + 1))
)
content_types = st.sampled_from(
    [
        "application/json",
        "application/json; charset=utf-8",
        "APPLICATION/JSON",
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data",
        "",
    ]
) | st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=30)
# What aiohttp's client will put in a header: visible ASCII and spaces (no CR, LF or NUL).
header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=80)
auths = st.sampled_from([f"Bearer {KEY}", f"bearer {KEY}"]) | header_text.map(
    lambda t: t if t != f"Bearer {KEY}" else t + "x"
)
routes = st.sampled_from(
    ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/chat/completions"]
)

# ---------------------------------------------------------------- against a running gateway


@pytest.fixture
async def gw() -> AsyncIterator[Gateway]:
    fast = SimConfig(instant=True)
    async with (
        fleet(fast, fast) as sims,
        gateway_with(
            sims,
            sections={
                "gateway": {"max_body_bytes": LIMIT},
                "dispatch": {"health_check_interval": 60},
            },
        ) as gw,
    ):
        yield gw


def _authorized(auth: str | None) -> bool:
    return (
        auth is not None
        and auth.partition(" ")[0].lower() == "bearer"
        and (auth.partition(" ")[2] == KEY)
    )


def _assert_error_shape(body: bytes) -> None:
    data = json.loads(body)
    assert isinstance(data, dict)
    assert set(data) == {"error"}, data
    error = data["error"]
    assert isinstance(error, dict)
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str)
    assert isinstance(error["type"], str)


@pytest.mark.slow  # a gateway and instances on loopback
@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    route=routes,
    body=bodies,
    content_type=content_types,
    auth=st.none() | auths,
    tag=st.none() | header_text,
    request_id=st.none() | header_text,
)
async def test_garbage_never_gets_a_5xx_and_a_wrong_key_never_reaches_an_instance(
    gw: Gateway,
    route: str,
    body: bytes,
    content_type: str,
    auth: str | None,
    tag: str | None,
    request_id: str | None,
) -> None:
    """Random requests never get a 5xx, 4xx are OpenAI-shaped, wrong keys reach no instance."""
    headers = {"Content-Type": content_type}
    for name, value in [
        ("Authorization", auth),
        ("X-Request-Tag", tag),
        ("X-Request-ID", request_id),
    ]:
        if value is not None:
            headers[name] = value
    before = sum(s.stats.requests for s in gw.sims)
    async with (
        aiohttp.ClientSession(skip_auto_headers=["Content-Type"]) as s,
        s.post(gw.url + route, data=body, headers=headers) as resp,
    ):
        answer = await resp.read()
        status = resp.status
    assert status < 500, (status, answer)
    if status >= 400:
        _assert_error_shape(answer)
    if not _authorized(auth):
        assert status in (400, 401), (status, answer)
        assert sum(s.stats.requests for s in gw.sims) == before


# ---------------------------------------------------------------- pure functions

KEYS = ["sk-one", "sk-two-rotated"]
# Header values come off the wire as UTF-8 with surrogateescape, so any bytes are possible.
wire_text = st.binary(max_size=80).map(lambda b: b.decode("utf-8", "surrogateescape"))


@settings(max_examples=400)
@given(st.none() | st.text(max_size=80) | wire_text)
def test_key_checker_never_raises(authorization: str | None) -> None:
    """KeyChecker.check answers a bool for any header value and never raises."""
    assert isinstance(KeyChecker((k, k) for k in KEYS).check(authorization), bool)


@settings(max_examples=200)
@given(
    st.sampled_from(["Bearer", "bearer", "BEARER"]), st.text(max_size=40) | st.sampled_from(KEYS)
)
def test_key_checker_accepts_exactly_the_configured_keys(scheme: str, token: str) -> None:
    """A bearer token is accepted exactly when it is one of the configured keys."""
    assert KeyChecker((k, k) for k in KEYS).check(f"{scheme} {token}") is (token in KEYS)


@settings(max_examples=200)
@given(
    st.none() | st.text(max_size=40) | st.sampled_from([f"Bearer {k}" for k in KEYS]),
    st.none() | wire_text | st.sampled_from(KEYS),
)
def test_an_x_api_key_is_a_key_as_a_bearer_token_is(
    authorization: str | None, api_key: str | None
) -> None:
    """`x-api-key` (Anthropic's header) holding a key is accepted as a Bearer token is; with
    both headers, one that holds a key is enough."""
    bearer = authorization.removeprefix("Bearer ") if authorization else None
    expected = bearer in KEYS or api_key in KEYS
    assert KeyChecker((k, k) for k in KEYS).check(authorization, api_key) is expected


@pytest.mark.slow  # 400 examples of deep JSON: seconds of generating
@settings(max_examples=400)
@given(json_like_dicts | openai_like)
def test_estimate_request_never_raises(body: dict[str, Any]) -> None:
    """estimate_request gives a non-negative int for any JSON object and never raises."""
    tokens = estimate_request(body)
    assert isinstance(tokens, int)
    assert tokens >= 0


def test_estimate_request_survives_deep_nesting() -> None:
    """estimate_request survives a prompt nested as deep as json.loads will parse."""
    depth = sys.getrecursionlimit() - 50
    body = json.loads('{"prompt": ' + "[" * depth + "]" * depth + "}")
    assert estimate_request(body) >= 0
