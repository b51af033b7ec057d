"""Helpers the simulated vLLM's tests share: an OpenAI client for a simulator and a chat
request body."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import openai

from gateway.sim.sim_vllm import SimInstance

MakeSim = Callable[..., Awaitable[SimInstance]]
CHAT_URL = "/v1/chat/completions"


def client_for(sim: SimInstance, **kwargs: Any) -> openai.AsyncOpenAI:
    """An OpenAI client pointed at the simulator, without retries so faults surface at once."""
    kwargs.setdefault("api_key", sim.config.api_key or "unused")
    kwargs.setdefault("max_retries", 0)
    return openai.AsyncOpenAI(base_url=sim.url + "/v1", **kwargs)


def chat_body(max_tokens: int = 5, content: str = "hello there", **extra: Any) -> dict[str, Any]:
    """A chat request body for the simulator's default model."""
    messages = [{"role": "user", "content": content}]
    return {"model": "sim-model", "messages": messages, "max_tokens": max_tokens, **extra}
