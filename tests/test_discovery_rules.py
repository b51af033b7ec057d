"""Discovery's rules as pure functions: what an answer does to an entry's set, and the
instances a set stands for (names, URLs, one address listed once)."""

from __future__ import annotations

import asyncio

from gateway.config.schema import InstanceConfig
from gateway.fleet.discovery import (
    EMPTY_ROUNDS,
    EntryState,
    ResolveFailed,
    instances_of,
    next_state,
    system_resolver,
)

A, B = ("10.0.0.5", 8000), ("10.0.0.6", 8000)


def test_an_answer_replaces_the_set_and_a_failure_keeps_it() -> None:
    state = next_state(EntryState(), [B, A, A], now=1.0)
    assert state.addresses == (A, B)  # sorted, once each
    assert state.resolved_at == 1.0
    failed = next_state(state, ResolveFailed("SERVFAIL"), now=2.0)
    assert failed.addresses == (A, B)  # the last good set stays
    assert (failed.error, failed.failing_since, failed.failures_total) == ("SERVFAIL", 2.0, 1)
    again = next_state(failed, ResolveFailed("SERVFAIL"), now=3.0)
    assert (again.failing_since, again.failures_total) == (2.0, 2)  # since the first
    healed = next_state(again, [A], now=4.0)
    assert (healed.addresses, healed.error, healed.failing_since) == ((A,), None, None)
    assert healed.failures_total == 2  # a count, not a state


def test_an_empty_answer_empties_the_entry_only_once_it_has_held() -> None:
    state = next_state(EntryState(), [A, B], now=0.0)
    for round_ in range(1, EMPTY_ROUNDS):
        state = next_state(state, [], now=float(round_))
        assert state.addresses == (A, B), round_
        assert state.empty_rounds == round_
    state = next_state(state, [], now=9.0)
    assert state.addresses == ()
    # One non-empty answer in between starts the count again.
    state = next_state(next_state(next_state(state, [A], 10.0), [], 11.0), [A], 12.0)
    assert (state.addresses, state.empty_rounds) == ((A,), 0)


def test_a_discovered_entry_stands_for_one_instance_per_address() -> None:
    static = InstanceConfig(url="http://10.0.0.6:8000")
    entry = InstanceConfig(
        url="http://user:pw@vllm-headless.ns.svc:8000",
        name="decode",
        discover="dns",
        role="decode",
        max_num_seqs=64,
    )
    plain = InstanceConfig(url="http://other.ns.svc:9000", discover="dns")
    states = {
        entry.url: EntryState(addresses=(A, B)),
        plain.url: EntryState(addresses=(("fd00::7", 9000),)),
    }
    out = instances_of([static, entry, plain], states)
    assert [i.label for i in out] == ["10.0.0.6:8000", "decode@10.0.0.5:8000", "[fd00::7]:9000"]
    found = out[1]
    assert found.url == "http://user:pw@10.0.0.5:8000"  # the credentials go with it
    assert (found.role, found.max_num_seqs, found.discover) == ("decode", 64, None)
    assert out[2].url == "http://[fd00::7]:9000"
    # Before the first answer an entry stands for nothing.
    assert instances_of([entry], {}) == []


def test_the_systems_resolver_reads_what_every_client_on_the_machine_reads() -> None:
    """localhost comes from /etc/hosts: no DNS server is asked."""
    found = asyncio.run(system_resolver("localhost", 8123))
    assert ("127.0.0.1", 8123) in found
    assert all(port == 8123 for _, port in found)
