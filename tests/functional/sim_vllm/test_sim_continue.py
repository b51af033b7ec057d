"""vLLM's `continue_final_message`, as the simulated instance answers it (request migration
sends it): the final assistant message is prompt, rendered open; with the generation
prompt left on it is a 400, as vLLM's request model says."""

from __future__ import annotations

import aiohttp
import pytest
from _sim_helpers import CHAT_URL, MakeSim

from gateway.sim.sim_engine import count_tokens

ASK = [{"role": "user", "content": "tell me about the sea"}]
SO_FAR = "The sea is wide and deep"


@pytest.mark.parametrize("blocks", [0, 4096])
async def test_a_continued_message_costs_its_text_over_the_original_prompt(
    make_sim: MakeSim, http: aiohttp.ClientSession, blocks: int
) -> None:
    sim = await make_sim(instant=True, prefix_cache_blocks=blocks)
    base = {"model": "sim-model", "max_tokens": 3}
    async with http.post(sim.url + CHAT_URL, json={**base, "messages": ASK}) as resp:
        original = (await resp.json())["usage"]["prompt_tokens"]
    continued = {
        **base,
        "messages": [*ASK, {"role": "assistant", "content": SO_FAR}],
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    async with http.post(sim.url + CHAT_URL, json=continued) as resp:
        assert resp.status == 200
        answer = await resp.json()
    assert answer["usage"]["prompt_tokens"] == original + count_tokens(SO_FAR)
    assert answer["choices"][0]["message"]["role"] == "assistant"


async def test_continuing_with_the_generation_prompt_on_is_a_400(
    make_sim: MakeSim, http: aiohttp.ClientSession
) -> None:
    sim = await make_sim(instant=True)
    body = {
        "model": "sim-model",
        "messages": [*ASK, {"role": "assistant", "content": SO_FAR}],
        "continue_final_message": True,  # add_generation_prompt defaults to true
    }
    async with http.post(sim.url + CHAT_URL, json=body) as resp:
        assert resp.status == 400
        assert "add_generation_prompt" in (await resp.json())["error"]["message"]
