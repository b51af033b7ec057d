"""The split decision under load (hypothesis, no event loop): it moves the right way as
either side gets busier, and a steady arrival rate gives a steady split, not a swing."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.dispatch import Hop, InstanceSpec, InstanceState, Lane, Ticket
from gateway.dispatch.disaggregation import split

STALE = 30.0


def instance(
    name: str, role: str, rate: float, pending: int = 0, inflight: int = 0
) -> InstanceState:
    state = InstanceState(InstanceSpec(name, role=role))  # type: ignore[arg-type]
    state.up = True
    state.speed.observe_prefill(rate, 1.0)
    state.pending_prefill_tokens = pending
    state.inflight = inflight
    return state


def decide(
    tokens: int,
    rate: float,
    pending: tuple[int, int],
    decode_load: int,
    transfer: float | None,
) -> bool:
    prefill = [
        instance("p1", "prefill", rate, pending[0]),
        instance("p2", "prefill", rate, pending[1]),
    ]
    decode = [instance("d", "decode", rate, inflight=decode_load)]
    ticket = Ticket(1, Lane.SHORT, 1e9, tokens=tokens)
    return split(prefill, decode, ticket, 0.0, transfer_s_per_token=transfer, stale_after=STALE)


tokens_st = st.integers(1, 20_000)
rate_st = st.floats(500.0, 50_000.0)
pending_st = st.integers(0, 100_000)
load_st = st.integers(0, 256)
transfer_st = st.none() | st.floats(1e-7, 1e-2)


@settings(max_examples=300, deadline=None)
@given(tokens_st, rate_st, pending_st, pending_st, load_st, st.integers(1, 64), transfer_st)
def test_a_busier_decode_instance_never_turns_a_split_into_a_whole(
    tokens: int, rate: float, a: int, b: int, load: int, more: int, transfer: float | None
) -> None:
    """Monotone in the decode side's load: more there only makes two hops more attractive."""
    if decide(tokens, rate, (a, b), load, transfer):
        assert decide(tokens, rate, (a, b), load + more, transfer)


@settings(max_examples=300, deadline=None)
@given(tokens_st, rate_st, pending_st, pending_st, load_st, st.integers(1, 50_000), transfer_st)
def test_a_busier_prefill_side_never_turns_a_whole_into_a_split(
    tokens: int, rate: float, a: int, b: int, load: int, more: int, transfer: float | None
) -> None:
    """Monotone in the prefill side's queue: more there only makes serving whole more
    attractive (both prefill instances busier)."""
    if not decide(tokens, rate, (a, b), load, transfer):
        assert not decide(tokens, rate, (a + more, b + more), load, transfer)


@dataclass
class _Fleet:
    """A 2P:1D fleet in virtual time, just detailed enough to feed the decision back: the
    prefill instances compute prompts in order at `rate`; an answer holds the decode
    instance for its prefill there (if whole) and then `decode_s`."""

    rate: float
    decode_s: float
    prefill: list[InstanceState] = field(default_factory=list)
    decode: InstanceState = field(default_factory=lambda: instance("d", "decode", 1.0))
    busy_until: list[float] = field(default_factory=lambda: [0.0, 0.0])
    events: list[tuple[float, int, str, int]] = field(default_factory=list)  # (at, seq, kind, arg)
    seq: int = 0

    def __post_init__(self) -> None:
        self.prefill = [instance(f"p{i}", "prefill", self.rate) for i in range(2)]
        self.decode = instance("d", "decode", self.rate)

    def at(self, when: float, kind: str, arg: int) -> None:
        self.seq += 1
        heapq.heappush(self.events, (when, self.seq, kind, arg))

    def advance(self, now: float) -> None:
        while self.events and self.events[0][0] <= now:
            when, _, kind, arg = heapq.heappop(self.events)
            if kind == "prefilled":  # its blocks reach the decode instance
                self.prefill[arg % 2].pending_prefill_tokens -= arg // 2
                self.decode.inflight += 1
                self.at(when + self.decode_s, "done", 0)
            else:
                self.decode.inflight -= 1

    def arrive(self, now: float, tokens: int) -> tuple[bool, bool]:
        """Whether the prompt arriving `now` splits, and whether it found the decode
        instance holding answers."""
        self.advance(now)
        held = self.decode.inflight > 0
        ticket = Ticket(1, Lane.SHORT, 1e9, tokens=tokens, hop=Hop.WHOLE)
        two = split(
            self.prefill, [self.decode], ticket, now, transfer_s_per_token=None, stale_after=STALE
        )
        if two:
            i = min((0, 1), key=lambda k: self.prefill[k].pending_prefill_tokens)
            start = max(now, self.busy_until[i])
            self.busy_until[i] = start + tokens / self.rate
            self.prefill[i].pending_prefill_tokens += tokens
            self.at(self.busy_until[i], "prefilled", tokens * 2 + i)
        else:
            self.decode.inflight += 1
            self.at(now + tokens / self.rate + self.decode_s, "done", 0)
        return two, held


@settings(max_examples=25, deadline=None)
@given(st.floats(0.3, 3.0), st.floats(200.0, 4000.0), st.floats(0.5, 5.0))
def test_a_steady_arrival_rate_gives_a_steady_split(
    load: float, tokens: float, decode_s: float
) -> None:
    """At a fixed arrival rate (`load` times what the two prefill instances compute), the
    share of prompts split settles: after a warm-up, every window of 100 arrivals splits
    within 0.2 of the others. With room on the prefill side (`load` under 0.8), nearly
    every prompt that finds answers on the decode instance goes in two hops."""
    rate = 5000.0
    size = int(tokens)
    interval = size / rate / 2 / load
    fleet = _Fleet(rate, decode_s)
    decisions = [fleet.arrive(i * interval, size) for i in range(3000)]
    splits = [two for two, _ in decisions]
    windows = [sum(splits[i : i + 100]) / 100 for i in range(2000, 3000, 100)]
    assert max(windows) - min(windows) <= 0.2, windows
    if load < 0.8:
        beside = [two for two, held in decisions[2000:] if held]
        assert sum(beside) >= 0.9 * len(beside), (sum(beside), len(beside))
