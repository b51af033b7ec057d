"""A mixed-model fleet through the OpenAI SDK: each model goes where it is served."""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections.abc import Callable
from typing import Any

import aiohttp
import openai
import pytest
from fakes import KEY, Gateway, fleet, gateway_with

from gateway.sim.sim_vllm import SimConfig, SimInstance

FAST = SimConfig(decode_s_per_token=0.001, prefill_tokens_per_s=1e6)
MODEL_A = dataclasses.replace(FAST, model="model-a")
MODEL_B = dataclasses.replace(FAST, model="model-b")
QUICK_HEALTH = {"dispatch": {"health_check_interval": 0.05}}


def client(gw: Gateway) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.base_url, api_key=KEY, max_retries=0)


async def ask(gw: Gateway, model: str) -> tuple[str, str]:
    """One chat for `model` through the SDK; returns the serving instance and the answer's model."""
    async with client(gw) as c:
        raw = await c.chat.completions.with_raw_response.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    return raw.headers["X-Gateway-Instance"], raw.parse().model


async def eventually(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


async def get_json(gw: Gateway, path: str) -> Any:
    async with (
        aiohttp.ClientSession() as s,
        s.get(gw.url + path, headers={"Authorization": f"Bearer {KEY}"}) as resp,
    ):
        assert resp.status == 200, await resp.text()
        return await resp.json()


def posts(sims: list[SimInstance]) -> list[int]:
    return [s.stats.requests for s in sims]


async def test_each_request_lands_on_the_instance_serving_its_model() -> None:
    """With one model-a and one model-b instance, all 10 model-a requests succeed on model-a's."""
    async with fleet(MODEL_A, MODEL_B) as sims, gateway_with(sims) as gw:
        a, b = gw.names()
        served = await asyncio.gather(*(ask(gw, "model-a") for _ in range(10)))
        assert served == [(a, "model-a")] * 10
        assert await ask(gw, "model-b") == (b, "model-b")
        assert posts(sims) == [10, 1]


async def test_unknown_model_gets_404_from_the_gateway_without_an_upstream_call() -> None:
    """A model nobody serves is answered 404 model_not_found, naming the available models."""
    async with fleet(MODEL_A, MODEL_B) as sims, gateway_with(sims) as gw:
        async with client(gw) as c:
            with pytest.raises(openai.NotFoundError) as caught:
                await c.chat.completions.create(
                    model="no-such-model", messages=[{"role": "user", "content": "hi"}]
                )
        assert caught.value.code == "model_not_found"
        assert caught.value.param == "model"
        assert "no-such-model" in caught.value.message
        assert "model-a" in caught.value.message
        assert "model-b" in caught.value.message
        assert posts(sims) == [0, 0]


async def test_instance_restarted_with_another_model_is_followed() -> None:
    """An instance that comes back on its port serving model-c gets model-c after a round."""
    async with (
        fleet(MODEL_A, MODEL_B) as sims,
        gateway_with(sims, sections=QUICK_HEALTH) as gw,
    ):
        a, b = gw.names()
        assert await ask(gw, "model-b") == (b, "model-b")
        port = int(sims[1].url.rsplit(":", 1)[1])
        await sims[1].stop()
        replacement = SimInstance(dataclasses.replace(FAST, model="model-c"))
        await replacement.start(port=port)
        try:
            state = gw.dispatcher.scheduler.state(b)
            await eventually(lambda: state.models == frozenset({"model-c"}))
            assert await ask(gw, "model-c") == (b, "model-c")
            assert replacement.stats.requests == 1
            async with client(gw) as c:
                with pytest.raises(openai.NotFoundError) as caught:
                    await c.chat.completions.create(
                        model="model-b", messages=[{"role": "user", "content": "hi"}]
                    )
            assert caught.value.code == "model_not_found"
            assert "model-c" in caught.value.message
            assert await ask(gw, "model-a") == (a, "model-a")
        finally:
            await replacement.stop()


async def test_model_whose_only_instance_is_down_gets_503_with_retry_after() -> None:
    """A served model whose one instance is down gets 503 + Retry-After; others still work."""
    async with (
        fleet(MODEL_A, MODEL_B) as sims,
        gateway_with(sims, sections=QUICK_HEALTH) as gw,
    ):
        a, b = gw.names()
        await sims[1].stop()
        clock = gw.dispatcher.clock
        await eventually(lambda: not gw.dispatcher.scheduler.state(b).available(clock()))
        before = posts(sims)
        async with client(gw) as c:
            with pytest.raises(openai.InternalServerError) as caught:
                await c.chat.completions.create(
                    model="model-b", messages=[{"role": "user", "content": "hi"}]
                )
        assert caught.value.status_code == 503
        assert caught.value.code == "no_instance_available"
        assert int(caught.value.response.headers["Retry-After"]) >= 1
        assert posts(sims) == before  # model-a's instance was not tried for it
        assert await ask(gw, "model-a") == (a, "model-a")


async def test_sim_lists_lora_adapters_and_refuses_unknown_models() -> None:
    """The simulator lists adapters with their base as parent, serves them, 404s the rest."""
    config = dataclasses.replace(MODEL_A, lora_adapters=("sql-lora",))
    async with fleet(config) as sims, aiohttp.ClientSession() as s:
        async with s.get(sims[0].url + "/v1/models") as resp:
            cards = {m["id"]: m for m in (await resp.json())["data"]}
        assert set(cards) == {"model-a", "sql-lora"}
        assert cards["sql-lora"]["parent"] == "model-a"
        assert cards["model-a"]["parent"] is None
        body = {"model": "sql-lora", "prompt": "x", "max_tokens": 1}
        async with s.post(sims[0].url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            assert (await resp.json())["model"] == "sql-lora"
        async with s.post(sims[0].url + "/v1/completions", json={**body, "model": "z"}) as resp:
            assert resp.status == 404
            assert "does not exist" in (await resp.json())["error"]["message"]


async def test_lora_adapters_listed_by_an_instance_are_routable() -> None:
    """A LoRA adapter in an instance's /v1/models is a model: it routes there, and is listed."""
    base = dataclasses.replace(MODEL_A, lora_adapters=("sql-lora", "chat-lora"))
    async with fleet(base, MODEL_B) as sims, gateway_with(sims) as gw:
        a, _ = gw.names()
        served = await asyncio.gather(*(ask(gw, "sql-lora") for _ in range(5)))
        assert served == [(a, "sql-lora")] * 5
        assert await ask(gw, "chat-lora") == (a, "chat-lora")
        assert posts(sims) == [6, 0]
        async with client(gw) as c:
            listed = {m.id: m for m in (await c.models.list()).data}
        assert set(listed) == {"model-a", "sql-lora", "chat-lora", "model-b"}
        assert listed["sql-lora"].model_extra is not None
        assert listed["sql-lora"].model_extra["parent"] == "model-a"


async def test_pinned_models_are_used_when_an_instance_hides_its_models_route() -> None:
    """Models pinned in settings route and list for an instance whose /v1/models fails."""
    hidden = dataclasses.replace(FAST, model="hidden-x")
    async with fleet(MODEL_A, hidden) as sims:
        sims[1].faults.models_status = 404
        instances = [{"url": sims[0].url}, {"url": sims[1].url, "models": ["hidden-x"]}]
        async with gateway_with(sims, instances=instances) as gw:
            a, b = gw.names()
            assert await ask(gw, "hidden-x") == (b, "hidden-x")
            assert await ask(gw, "model-a") == (a, "model-a")
            async with client(gw) as c:
                listed = [m.id for m in (await c.models.list()).data]
                with pytest.raises(openai.NotFoundError):
                    await c.chat.completions.create(
                        model="other-y", messages=[{"role": "user", "content": "hi"}]
                    )
            assert sorted(listed) == ["hidden-x", "model-a"]
            assert posts(sims) == [1, 1]


async def test_admin_instances_shows_each_instances_models() -> None:
    """/admin/instances lists each instance's models and whether they were pinned."""
    hidden = dataclasses.replace(FAST, model="hidden-x")
    base = dataclasses.replace(MODEL_A, lora_adapters=("sql-lora",))
    async with fleet(base, hidden) as sims:
        sims[1].faults.models_status = 404
        instances = [{"url": sims[0].url}, {"url": sims[1].url, "models": ["hidden-x"]}]
        async with gateway_with(sims, instances=instances) as gw:
            body = await get_json(gw, "/admin/instances")
    assert [(r["models"], r["models_pinned"]) for r in body["instances"]] == [
        (["model-a", "sql-lora"], False),
        (["hidden-x"], True),
    ]


async def test_requests_metric_model_label_takes_only_served_models() -> None:
    """gateway_requests_total labels served models by name; an unknown model never appears."""
    async with fleet(MODEL_A, MODEL_B) as sims, gateway_with(sims) as gw:
        await ask(gw, "model-a")
        async with client(gw) as c:
            for i in range(5):
                with pytest.raises(openai.NotFoundError):
                    await c.chat.completions.create(
                        model=f"made-up-{i}", messages=[{"role": "user", "content": "hi"}]
                    )
        async with aiohttp.ClientSession() as s:
            text = await (await s.get(gw.url + "/metrics")).text()
    labels = set(re.findall(r'^gateway_requests_total\{[^}]*model="([^"]*)"', text, re.M))
    assert "model-a" in labels
    assert labels <= {"model-a", "model-b", "other", "none"}
    assert "made-up" not in text
