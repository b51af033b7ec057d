"""The simulated vLLM's answer lengths: an answer ends on its own at a length drawn from the
seed and the prompt, unless max_tokens cuts it first or the request sets ignore_eos."""

from __future__ import annotations

import statistics

import pytest

from gateway.sim.sim_engine import (
    MAX_MODEL_LEN,
    ApiError,
    Generation,
    SimConfig,
    answer_tokens,
    parse_ignore_eos,
    parse_max_tokens,
    tokens_to_generate,
)
from gateway.sim.sim_fleet import _build_parser


def prompt(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"question number {i}"}]


def test_the_length_is_fixed_by_the_seed_and_the_prompt() -> None:
    """The same seed and prompt give the same length; another seed or prompt, mostly not."""
    assert answer_tokens(0, prompt(1), 200) == answer_tokens(0, prompt(1), 200)
    other_seed = sum(
        answer_tokens(0, prompt(i), 200) != answer_tokens(1, prompt(i), 200) for i in range(100)
    )
    other_prompt = sum(
        answer_tokens(0, prompt(i), 200) != answer_tokens(0, prompt(i + 1), 200) for i in range(100)
    )
    assert other_seed > 90
    assert other_prompt > 90


def test_lengths_spread_around_the_median() -> None:
    """Over many prompts the lengths' median is near the configured one, and they spread
    (some a tenth of it, some several times it), all within 1 and the context."""
    lengths = [answer_tokens(7, prompt(i), 200) for i in range(3000)]
    assert 180 <= statistics.median(lengths) <= 220
    assert min(lengths) >= 1
    assert max(lengths) <= MAX_MODEL_LEN
    assert sum(n < 40 for n in lengths) > 30  # below a fifth of the median: about 5 %
    assert sum(n > 1000 for n in lengths) > 30  # past five times the median: about 5 %


def test_max_tokens_cuts_and_ignore_eos_fills() -> None:
    """The length generated is the natural one under max_tokens, max_tokens above it, and
    max_tokens always with ignore_eos."""
    config = SimConfig(seed=3, answer_tokens_median=50)
    natural = answer_tokens(3, prompt(0), 50)
    assert tokens_to_generate(config, prompt(0), natural + 100, ignore_eos=False) == natural
    assert tokens_to_generate(config, prompt(0), natural + 100, ignore_eos=True) == natural + 100
    assert tokens_to_generate(config, prompt(0), 1, ignore_eos=False) == 1


def test_ignore_eos_is_read_as_vllm_reads_it() -> None:
    """Absent is False; pydantic's lax bool takes "true" and 1; anything else is a 400."""
    assert parse_ignore_eos({}) is False
    assert parse_ignore_eos({"ignore_eos": True}) is True
    assert parse_ignore_eos({"ignore_eos": "true"}) is True
    assert parse_ignore_eos({"ignore_eos": 0}) is False
    with pytest.raises(ApiError) as caught:
        parse_ignore_eos({"ignore_eos": "sometimes"})
    assert caught.value.status == 400
    assert "ignore_eos" in caught.value.message


def test_finish_reason_is_length_only_at_max_tokens() -> None:
    """An answer that stopped short says "stop"; one that reached max_tokens says "length"."""
    gen = Generation(id="x", created=0, model="m", chat=True, prompt_tokens=1, max_tokens=3)
    gen.tokens = [" the", " and"]
    assert gen.finish_reason == "stop"
    assert gen.full_body()["choices"][0]["finish_reason"] == "stop"
    gen.tokens.append(" for")
    assert gen.finish_reason == "length"


def test_no_default_limit_is_the_rest_of_the_context() -> None:
    """default_max_tokens None is vLLM's default: the context left after the prompt."""
    assert parse_max_tokens({}, None, 1000) == MAX_MODEL_LEN - 1000
    assert parse_max_tokens({}, 16, 1000) == 16
    with pytest.raises(ValueError, match="default_max_tokens"):
        SimConfig(default_max_tokens=0)
    with pytest.raises(ValueError, match="answer_tokens_median"):
        SimConfig(answer_tokens_median=0)


def test_the_fleet_command_takes_the_median() -> None:
    """`python -m gateway.sim.sim_fleet --answer-tokens-median N` sets it; 200 when not given."""
    assert _build_parser("fleet").parse_args([]).answer_tokens_median == 200
    args = _build_parser("fleet").parse_args(["--answer-tokens-median", "50"])
    assert args.answer_tokens_median == 50
