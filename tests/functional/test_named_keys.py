"""Named keys through the real OpenAI and Anthropic SDKs: who a request is, the models each
key may use, and what the access line says of it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anthropic
import openai
import pytest
import structlog
from fakes import KEY, Gateway, fleet, gateway_with

from gateway.sim.sim_vllm import SimConfig

TEAM_KEY = "sk-team-a-0123456789abcdef"
OTHER_KEY = "sk-other-fedcba9876543210"
# One instance serving a base model and an adapter: two models a key may or may not use.
TWO_MODELS = SimConfig(instant=True, lora_adapters=("adapter-a",))
KEYS = [
    {"name": "team-a", "key": TEAM_KEY, "models": ["adapter-a"]},
    {"name": "other", "key": OTHER_KEY},
]
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def gw() -> AsyncIterator[Gateway]:
    async with fleet(TWO_MODELS) as sims, gateway_with(sims, channel={"keys": KEYS}) as gw:
        yield gw


def client(gw: Gateway, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.base_url, api_key=key, max_retries=0)


def access_lines(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == "request"]


async def test_each_key_is_named_in_its_access_line(gw: Gateway) -> None:
    """Requests with the unnamed key, a named key and a wrong key log `default`, the name,
    and no key; no line holds a key itself."""
    with structlog.testing.capture_logs() as events:
        for key in (KEY, OTHER_KEY):
            async with client(gw, key) as c:
                await c.chat.completions.create(model="sim-model", messages=HI, max_tokens=2)
        async with client(gw, "sk-wrong") as c:
            with pytest.raises(openai.AuthenticationError):
                await c.chat.completions.create(model="sim-model", messages=HI, max_tokens=2)
    lines = access_lines(events)
    assert [(line["status"], line["key"]) for line in lines] == [
        (200, "default"),
        (200, "other"),
        (401, None),
    ]
    assert not any(k in str(events) for k in (KEY, OTHER_KEY, TEAM_KEY))


async def test_a_key_may_use_its_models_only(gw: Gateway) -> None:
    """team-a gets its adapter; the base model is refused as OpenAI refuses a project key
    without the model: 403, invalid_request_error, model_not_found."""
    async with client(gw, TEAM_KEY) as c:
        answer = await c.chat.completions.create(model="adapter-a", messages=HI, max_tokens=2)
        assert answer.model == "adapter-a"
        with (
            structlog.testing.capture_logs() as events,
            pytest.raises(openai.PermissionDeniedError) as denied,
        ):
            await c.chat.completions.create(model="sim-model", messages=HI, max_tokens=2)
    assert denied.value.status_code == 403
    body = denied.value.body
    assert isinstance(body, dict)
    assert (body["type"], body["code"], body["param"]) == (
        "invalid_request_error",
        "model_not_found",
        "model",
    )
    assert "'team-a' does not have access to model 'sim-model'" in body["message"]
    (line,) = access_lines(events)
    assert (line["status"], line["key"], line["model"]) == (403, "team-a", "sim-model")
    assert gw.sims[0].stats.requests == 1  # the refused request reached no instance


async def test_a_restricted_key_lists_and_is_told_of_its_models_only(gw: Gateway) -> None:
    """/v1/models and a 404's list show team-a only its adapter; the requested model is in
    the access line, not a metric label."""
    async with client(gw, TEAM_KEY) as c:
        listed = [m.id async for m in c.models.list()]
        with (
            structlog.testing.capture_logs() as events,
            pytest.raises(openai.NotFoundError) as missing,
        ):
            await c.chat.completions.create(model="no-such-" + "m" * 300, messages=HI)
    assert listed == ["adapter-a"]
    assert "available models: adapter-a" in str(missing.value)
    assert "sim-model" not in str(missing.value)
    (line,) = access_lines(events)
    assert (line["status"], line["model"], line["key"]) == (404, "other", "team-a")
    assert line["requested_model"] == ("no-such-" + "m" * 300)[:100]
    async with client(gw, OTHER_KEY) as c:
        assert sorted([m.id async for m in c.models.list()]) == ["adapter-a", "sim-model"]


async def test_the_messages_route_refuses_a_model_in_anthropics_shape(gw: Gateway) -> None:
    """The Anthropic SDK raises PermissionDeniedError with Anthropic's permission_error."""
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key=TEAM_KEY, max_retries=0) as c:
        with pytest.raises(anthropic.PermissionDeniedError) as denied:
            await c.messages.create(model="sim-model", max_tokens=2, messages=HI)
        answer = await c.messages.create(model="adapter-a", max_tokens=2, messages=HI)
    body = denied.value.body
    assert isinstance(body, dict)
    assert body["type"] == "error"
    assert body["error"]["type"] == "permission_error"
    assert answer.model == "adapter-a"
