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
    """C conversations of T turns; user messages and answers drawn from token ranges.

    With `users` (> 0) the workload is users who converse instead: each user, a closed loop,
    thinks a random time (exponential, mean `think_s`) after each answer before their next
    turn, and starts a new conversation of T turns when one ends. Each user joins the run in
    the middle of a conversation (at a turn drawn uniformly), so the histories live at any
    moment are spread over every stage, as in a deployment that has been running a while,
    and a user's first request re-sends a history that no cache holds. `conversations` is
    then unused; each user has `requests_per_user` requests ready, more than a run sends
    (`run_conversations` stops them at its `duration`).
    """

    conversations: int = 16
    turns: int = 4
    user_tokens: tuple[int, int] = (100, 400)
    max_tokens: tuple[int, int] = (32, 128)
    users: int = 0
    think_s: float = 0.0
    requests_per_user: int = 40

    def __post_init__(self) -> None:
        if self.conversations < 1 or self.turns < 1:
            raise ValueError(
                f"conversations and turns must be >= 1, got {(self.conversations, self.turns)}"
            )
        _check_range("user_tokens", self.user_tokens)
        _check_range("max_tokens", self.max_tokens)
        if self.users < 0 or self.think_s < 0 or self.requests_per_user < 1:
            raise ValueError(
                "users and think_s must be >= 0 and requests_per_user >= 1, got "
                f"{(self.users, self.think_s, self.requests_per_user)}"
            )


def _conversation(
    mix: ConversationMix, conversation: int, rng: random.Random
) -> list[tuple[tuple[tuple[str, str], ...], int, int]]:
    """Every turn of one conversation: (its messages, its prompt tokens, its max_tokens)."""
    out = []
    history: tuple[tuple[str, str], ...] = ()
    for _ in range(mix.turns):
        user = unique_word(conversation) + _words(rng, rng.randint(*mix.user_tokens) - 1)
        history += (("user", user),)
        max_tokens = rng.randint(*mix.max_tokens)
        count = count_message_tokens([{"content": text} for _, text in history])
        out.append((history, count - TEMPLATE_TOKENS, max_tokens))
        history += (("assistant", _words(rng, max_tokens)),)
    return out


def make_conversations(
    mix: ConversationMix, seed: int, *, rate: float | None = None, clients: int = 16
) -> list[RequestSpec]:
    """Every turn of every conversation, conversation by conversation, turns in order.

    A conversation's first turn is sent at its `at` (all at 0, or Poisson starts at `rate`
    per second); `run_conversations` sends each later turn when the one before has finished.
    With `mix.users`, see `make_users`.
    """
    if mix.users:
        return make_users(mix, seed, clients=clients)
    rng = random.Random(seed)
    specs: list[RequestSpec] = []
    start = 0.0
    for conversation in range(mix.conversations):
        if rate is not None and conversation > 0:
            start += rng.expovariate(rate)
        for turn, (messages, tokens, max_tokens) in enumerate(
            _conversation(mix, conversation, rng)
        ):
            specs.append(
                RequestSpec(
                    index=len(specs),
                    at=start,
                    prompt_tokens=tokens,
                    max_tokens=max_tokens,
                    client=conversation % max(1, clients),
                    messages=messages,
                    conversation=conversation,
                    turn=turn,
                )
            )
    return specs


def make_users(mix: ConversationMix, seed: int, *, clients: int = 16) -> list[RequestSpec]:
    """`mix.users` users' requests, user by user, each user's in the order they send them.

    A user's first request goes at a time drawn uniformly within the mean think time (so
    the users do not all start at once), at a turn drawn uniformly in its conversation;
    every later one after an exponential think time (`think`). Conversation numbers are
    unique across users.
    """
    rng = random.Random(seed)
    specs: list[RequestSpec] = []
    conversation = 0
    for user in range(mix.users):
        at = rng.uniform(0.0, mix.think_s)
        turn = rng.randrange(mix.turns)
        sent = 0
        while sent < mix.requests_per_user:
            turns = _conversation(mix, conversation, rng)
            for k in range(turn, mix.turns):
                if sent == mix.requests_per_user:
                    break
                messages, tokens, max_tokens = turns[k]
                think = rng.expovariate(1.0 / mix.think_s) if mix.think_s and sent else 0.0
                specs.append(
                    RequestSpec(
                        index=len(specs),
                        at=at,
                        prompt_tokens=tokens,
                        max_tokens=max_tokens,
                        client=user % max(1, clients),
                        messages=messages,
                        conversation=conversation,
                        turn=k,
                        user=user,
                        think=think,
                    )
                )
                sent += 1
            conversation += 1
            turn = 0
    return specs


async def run_conversations(
    client: Client,
    specs: Sequence[RequestSpec],
    route: Route,
    *,
    label: str,
    limit: float,
    duration: float | None = None,
) -> Run:
    """Send each conversation's turns in order (each user's requests, for users), the next
    when the last has finished and, for users, its think time has passed.

    Conversations start at their first turn's `at` and run side by side; at most `limit` s.
    With `duration`, no request is sent after `duration` s: the run is a closed system
    measured for a fixed time, and the requests not sent are not part of it (not counted
    as unfinished), so a faster front serves more of them.
    """
    run = Run(label)
    progress = Progress(run, len(specs))
    by_sender: dict[int, list[RequestSpec]] = {}
    for spec in specs:
        key = spec.user if spec.user >= 0 else spec.conversation
        by_sender.setdefault(key, []).append(spec)
    stopped = 0

    async def converse(turns: list[RequestSpec]) -> None:
        nonlocal stopped
        delay = run.started + turns[0].at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        ordered = turns if turns[0].user >= 0 else sorted(turns, key=lambda s: s.turn)
        for n, spec in enumerate(ordered):
            think = spec.think
            if duration is not None:
                # A user still thinking at the end sends nothing more: stop then, not
                # when the think time is over, so the run ends with its last answer.
                think = min(think, run.started + duration - time.perf_counter())
            if think > 0:
                await asyncio.sleep(think)
            if duration is not None and time.perf_counter() - run.started >= duration:
                stopped += len(ordered) - n
                return
            progress.sent += 1
            run.last_sent = time.perf_counter()
            run.results.append(await client.send(route(spec, spec.client), spec))

    async def all_conversations() -> None:
        await asyncio.gather(*(converse(turns) for turns in by_sender.values()))

    run.started = time.perf_counter()
    await _bounded(run, progress, asyncio.create_task(all_conversations()), limit)
    run.unfinished = len(specs) - stopped - len(run.results)
    return run
