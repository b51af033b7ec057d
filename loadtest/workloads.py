"""Shared-prefix workloads: prompt groups with a common prefix, and multi-turn conversations.

Both are built from a seed, like `loadgen.make_workload`, and send chat messages whose
text the simulator tokenizes 4 UTF-8 bytes to a token: every word here is exactly 4 ASCII
bytes, so a shared text prefix is the same run of leading token ids. The chat template adds
the same 4 framing ids before each message, which keeps a first message's prefix shared.

- `make_prefix_workload`: G groups, each a fixed prefix of P tokens; a request is its
  group's prefix and a unique suffix of S tokens, in one user message. The group is drawn
  uniformly, or by Zipf(s): group g (from 0) with weight 1 / (g + 1) ** s.
- `make_conversations` + `run_conversations`: C conversations of T turns; turn k + 1
  re-sends turn k's messages, an assistant answer of turn k's max_tokens tokens (a stand-in
  text: the simulator answers exactly max_tokens tokens) and a new user message, and is sent
  when turn k has finished (a closed loop per conversation).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.sim.sim_engine import VOCAB, count_message_tokens
from loadtest.loadgen import (
    TEMPLATE_TOKENS,
    Client,
    Progress,
    RequestSpec,
    Route,
    Run,
    _bounded,
)

# Distinct words: two varying bytes, so each maps to its own simulator token id.
_WORD_SPAN = (94, 92)  # first byte 33..126, second 33..124: b0 + 256 * b1 stays < 32000


def unique_word(n: int) -> str:
    """A 4-byte word whose simulator token id differs for each n in 0..8647 (then repeats)."""
    first, second = _WORD_SPAN
    n %= first * second
    return chr(33 + n % first) + chr(33 + n // first) + "_#"


def _words(rng: random.Random, count: int) -> str:
    return "".join(rng.choices(VOCAB, k=max(0, count)))


def _check_range(name: str, value: tuple[int, int]) -> None:
    lo, hi = value
    if not 1 <= lo <= hi:
        raise ValueError(f"{name} must be 1 <= low <= high, got {value}")


@dataclass(frozen=True)
class PrefixMix:
    """G groups of P-token prefixes, S-token suffixes, Zipf(s) popularity (0: uniform)."""

    groups: int = 32
    prefix_tokens: int = 4000
    suffix_tokens: int = 200
    zipf: float = 0.0
    max_tokens: tuple[int, int] = (32, 128)

    def __post_init__(self) -> None:
        if self.groups < 1 or self.prefix_tokens < 1 or self.suffix_tokens < 1:
            raise ValueError(
                "groups, prefix_tokens and suffix_tokens must be >= 1, got "
                f"{(self.groups, self.prefix_tokens, self.suffix_tokens)}"
            )
        if self.zipf < 0:
            raise ValueError(f"zipf must be >= 0 (0: uniform), got {self.zipf}")
        _check_range("max_tokens", self.max_tokens)

    def mean_prompt_tokens(self) -> float:
        """Prompt tokens per request, template included (as `Mix.mean_prompt_tokens`)."""
        return TEMPLATE_TOKENS + self.prefix_tokens + self.suffix_tokens

    def mean_max_tokens(self) -> float:
        return sum(self.max_tokens) / 2

    def weights(self) -> list[float]:
        """Relative popularity of each group: 1 / (g + 1) ** zipf."""
        return [1.0 / (g + 1) ** self.zipf for g in range(self.groups)]


def group_prefix(group: int, tokens: int, seed: int) -> str:
    """The fixed prefix text of a group: `tokens` tokens, starting with a word unique to it."""
    rng = random.Random(f"{seed}-prefix-{group}")
    return unique_word(group) + _words(rng, tokens - 1)


def make_prefix_workload(
    count: int, mix: PrefixMix, seed: int, *, rate: float | None = None, clients: int = 16
) -> list[RequestSpec]:
    """`count` requests over mix.groups shared prefixes; Poisson arrivals at `rate` if given."""
    rng = random.Random(seed)
    prefixes = [group_prefix(g, mix.prefix_tokens, seed) for g in range(mix.groups)]
    cumulative: list[float] = []
    total = 0.0
    for weight in mix.weights():
        total += weight
        cumulative.append(total)
    specs: list[RequestSpec] = []
    at = 0.0
    for index in range(count):
        if rate is not None and index > 0:
            at += rng.expovariate(rate)
        group = rng.choices(range(mix.groups), cum_weights=cumulative)[0]
        # The suffix's first word is unique per request, so the shared run ends exactly at P.
        suffix = unique_word(index) + _words(rng, mix.suffix_tokens - 1)
        messages = (("user", prefixes[group] + suffix),)
        specs.append(
            RequestSpec(
                index=index,
                at=at,
                prompt_tokens=mix.prefix_tokens + mix.suffix_tokens,
                max_tokens=rng.randint(*mix.max_tokens),
                client=index % max(1, clients),
                messages=messages,
                group=group,
            )
        )
    return specs


@dataclass(frozen=True)
class ConversationMix:
    """C conversations of T turns; user messages and answers drawn from token ranges."""

    conversations: int = 16
    turns: int = 4
    user_tokens: tuple[int, int] = (100, 400)
    max_tokens: tuple[int, int] = (32, 128)

    def __post_init__(self) -> None:
        if self.conversations < 1 or self.turns < 1:
            raise ValueError(
                f"conversations and turns must be >= 1, got {(self.conversations, self.turns)}"
            )
        _check_range("user_tokens", self.user_tokens)
        _check_range("max_tokens", self.max_tokens)


def make_conversations(
    mix: ConversationMix, seed: int, *, rate: float | None = None, clients: int = 16
) -> list[RequestSpec]:
    """Every turn of every conversation, conversation by conversation, turns in order.

    A conversation's first turn is sent at its `at` (all at 0, or Poisson starts at `rate`
    per second); `run_conversations` sends each later turn when the one before has finished.
    """
    rng = random.Random(seed)
    specs: list[RequestSpec] = []
    start = 0.0
    for conversation in range(mix.conversations):
        if rate is not None and conversation > 0:
            start += rng.expovariate(rate)
        history: tuple[tuple[str, str], ...] = ()
        for turn in range(mix.turns):
            user = unique_word(conversation) + _words(rng, rng.randint(*mix.user_tokens) - 1)
            history += (("user", user),)
            max_tokens = rng.randint(*mix.max_tokens)
            count = count_message_tokens([{"content": text} for _, text in history])
            specs.append(
                RequestSpec(
                    index=len(specs),
                    at=start,
                    prompt_tokens=count - TEMPLATE_TOKENS,
                    max_tokens=max_tokens,
                    client=conversation % max(1, clients),
                    messages=history,
                    conversation=conversation,
                    turn=turn,
                )
            )
            history += (("assistant", _words(rng, max_tokens)),)
    return specs


async def run_conversations(
    client: Client, specs: Sequence[RequestSpec], route: Route, *, label: str, limit: float
) -> Run:
    """Send each conversation's turns in order, the next when the last has finished.

    Conversations start at their first turn's `at` and run side by side; at most `limit` s.
    """
    run = Run(label)
    progress = Progress(run, len(specs))
    by_conversation: dict[int, list[RequestSpec]] = {}
    for spec in specs:
        by_conversation.setdefault(spec.conversation, []).append(spec)

    async def converse(turns: list[RequestSpec]) -> None:
        delay = run.started + turns[0].at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        for spec in sorted(turns, key=lambda s: s.turn):
            progress.sent += 1
            if progress.sent == len(specs):
                run.last_sent = time.perf_counter()
            run.results.append(await client.send(route(spec, spec.client), spec))

    async def all_conversations() -> None:
        await asyncio.gather(*(converse(turns) for turns in by_conversation.values()))

    run.started = time.perf_counter()
    await _bounded(run, progress, asyncio.create_task(all_conversations()), limit)
    run.unfinished = len(specs) - len(run.results)
    return run
