"""What one gateway process publishes for the others, and how the others' are summed."""

from __future__ import annotations

import random

import pytest

from gateway.dispatch import (
    STRATEGIES,
    InstanceSpec,
    Lane,
    Limits,
    LocalShare,
    PeerLoad,
    Priority,
    Scheduler,
    Ticket,
)
from gateway.fleet.shared_codec import (
    MAX_ENTRY_BYTES,
    Refused,
    combine,
    decode,
    encode,
    newest,
    parse_placements,
    parse_push,
    push_key,
    push_message,
    redacted,
)

FAR = 1e9


def make(*specs: InstanceSpec) -> Scheduler:
    sched = Scheduler(list(specs), STRATEGIES["least_busy"](30.0), Limits())
    for state in sched.instances.states:
        sched.probe(state.name, True, 0.0, random.Random(0))
    return sched


def test_publications_round_trip_and_sum() -> None:
    """encode/decode keep a publication whole; combine sums loads and queues, keeps speeds."""
    rng = random.Random(0)
    sched = make(InstanceSpec("a"), InstanceSpec("b"))
    sched.submit(Ticket(1, Lane.SHORT, FAR, tokens=40), 0.0, rng)
    sched.state("a").speed.observe_tpot(0.02)
    entry = decode(encode(sched.share(0.0), 12, 3))
    assert entry.share == sched.share(0.0)
    assert (entry.requests, entry.retries) == (12, 3)
    view = combine([entry, entry])
    assert view.peers == 2
    assert sum(load.inflight for load in view.loads.values()) == 2
    assert len(view.speeds["a"]) == 2


def test_of_two_publications_of_one_process_the_higher_numbered_wins() -> None:
    """A round's key read after a newer push does not replace it: the sequence decides."""
    sched = make(InstanceSpec("a"))
    older = decode(encode(sched.share(0.0), 1, 0, seq=7))
    newer = decode(encode(sched.share(0.0), 2, 0, seq=8))
    assert (older.seq, newer.seq) == (7, 8)
    assert newest(newer, older) is newer
    assert newest(older, newer) is newer
    assert newest(None, older) is older


def test_a_push_names_its_process_and_carries_its_publication() -> None:
    """A push is the process id, the publication and the new placements; no id: refused."""
    sched = make(InstanceSpec("a"))
    payload = encode(sched.share(0.0), 3, 1, seq=2)
    assert parse_push(push_message("host-12-ab", payload)) == ("host-12-ab", payload, [], [])
    message = push_message("host-12-ab", payload, [("a", (7, 8, 9))])
    assert parse_push(message.decode()) == ("host-12-ab", payload, [("a", [7, 8, 9])], [])
    message = push_message("host-12-ab", payload, [], [("b", (5,))])
    assert parse_push(message) == ("host-12-ab", payload, [], [("b", [5])])
    for bad in (b"", b"no-space", b" starts-with-space", b"id {}\n[[1]]", b"id {}\nnope"):
        with pytest.raises(ValueError, match="malformed"):
            parse_push(bad)


def test_a_push_is_due_when_load_or_queues_change_not_speeds() -> None:
    """push_key moves with a request placed, not with a speed learned (speeds ride along)."""
    rng = random.Random(0)
    sched = make(InstanceSpec("a"), InstanceSpec("b"))
    before = push_key(sched.share(0.0))
    sched.state("a").speed.observe_tpot(0.02)
    assert push_key(sched.share(0.0)) == before
    sched.submit(Ticket(1, Lane.SHORT, FAR, tokens=40), 0.0, rng)
    assert push_key(sched.share(0.0)) != before


def test_long_prefills_travel_and_sum_and_an_older_publication_still_reads() -> None:
    """Long prefills per instance survive the codec and add up; two-number loads mean none."""
    rng = random.Random(0)
    sched = make(InstanceSpec("a"))
    sched.submit(Ticket(1, Lane.LONG, FAR, tokens=6000), 0.0, rng)
    entry = decode(encode(sched.share(0.0), 0, 0))
    assert combine([entry, entry]).loads["a"].long_prefilling == 2
    assert combine([entry, entry]).loads["a"].long_running == 2
    old = b'{"loads":{"a":[3,500]},"speeds":{},"queued":{},"budget":[0,0]}'
    assert decode(old).share.loads["a"].long_prefilling == 0
    three = b'{"loads":{"a":[3,500,1]},"speeds":{},"queued":{},"budget":[0,0]}'
    assert decode(three).share.loads["a"] == PeerLoad(3, 500, 1, 0)


INTER, BATCH = Priority.INTERACTIVE, Priority.BATCH


def test_departure_rates_travel_by_lane_model_and_class_and_sum() -> None:
    """Each process's saturated departure rates survive the codec and add up per lane, model
    and class; so does its count of batch requests queued."""
    rates = {
        (Lane.SHORT, None, INTER): 2.0,
        (Lane.LONG, "m", INTER): 0.5,
        (Lane.SHORT, None, BATCH): 0.25,
    }
    share = LocalShare({}, {}, {Lane.SHORT: 5}, rates, {Lane.SHORT: 3})
    entry = decode(encode(share, 0, 0))
    assert entry.share.rates == share.rates
    assert entry.share.queued_batch == {Lane.SHORT: 3}
    view = combine([entry, entry])
    assert view.rates == {
        (Lane.SHORT, None, INTER): 4.0,
        (Lane.LONG, "m", INTER): 1.0,
        (Lane.SHORT, None, BATCH): 0.5,
    }
    assert view.queued_batch == {Lane.SHORT: 6}


def test_a_publication_from_before_classes_is_all_interactive() -> None:
    """A process that knows no classes publishes rates of three items and no batch count:
    its rates are the interactive class's, its queue none of it batch."""
    old = b'{"loads":{},"speeds":{},"queued":{"short":4},"rates":[["short",null,2.0]],'
    old += b'"budget":[0,0]}'
    share = decode(old).share
    assert share.rates == {(Lane.SHORT, None, INTER): 2.0}
    assert share.queued_batch == {}


def test_a_rate_of_an_unknown_class_is_refused() -> None:
    bad = b'{"loads":{},"speeds":{},"queued":{},"rates":[["short",null,2.0,"vip"]],'
    bad += b'"budget":[0,0]}'
    with pytest.raises(ValueError, match="vip"):
        decode(bad)


@pytest.mark.parametrize(
    "data", [b"", b"{}", b'{"loads": {"a": [1]}}', b"not json", b'{"loads": 3}']
)
def test_a_malformed_publication_raises_value_error(data: bytes) -> None:
    """A peer writing garbage raises ValueError, the one error the reader catches and logs."""
    with pytest.raises(ValueError, match=r"malformed|Expecting"):
        decode(data)


def test_a_redis_url_is_logged_without_its_password() -> None:
    """The URL in logs keeps scheme, host and port, never user or password."""
    assert redacted("redis://:s3cret@cache.internal:6380/0") == "redis://cache.internal:6380"
    assert "s3cret" not in redacted("rediss://user:s3cret@host/1")


async def test_a_cancellation_swallowed_inside_a_round_still_stops_the_loop() -> None:
    """If the Redis client swallows the cancellation mid-command, run_forever still ends."""
    import asyncio
    import contextlib

    from gateway.fleet.shared import SharedState

    class Swallowing(SharedState):
        async def run_round(self) -> bool:
            # What redis-py 8.1 sometimes does with a cancellation during a command:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(10)
            return True

    shared = Swallowing.__new__(Swallowing)
    shared.interval = 0.01
    shared.push_interval = 0  # the rounds alone: the loop under test
    shared.strict_caps = False
    task = asyncio.create_task(shared.run_forever())
    await asyncio.sleep(0.05)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=2)
    try:
        assert task in done, "run_forever kept looping after its cancellation was swallowed"
        assert task.cancelled()
    finally:
        shared.run_round = lambda: asyncio.sleep(0, True)  # type: ignore[method-assign]
        task.cancel()


def _entry(load: str, extra: str = "") -> bytes:
    """A publication as a peer (or whoever writes to Redis) may write it, load for `a`."""
    return (
        '{"loads":{"a":' + load + '},"speeds":{},"queued":{},"budget":[0,0],"seq":1' + extra + "}"
    ).encode()


@pytest.mark.parametrize(
    "load",
    ["[Infinity,0,0,0]", "[NaN,0,0,0]", "[-3,0,0,0]", "[1e9,0,0,0]", "[1.5,0,0,0]", '["1",0]'],
)
def test_a_number_no_peer_could_hold_refuses_the_entry(load: str) -> None:
    """Non-finite, negative, fractional, absurd or non-numeric counts: the entry is refused."""
    with pytest.raises(Refused) as refused:
        decode(_entry(load))
    assert refused.value.reason in ("out_of_bounds", "malformed")


def test_an_entry_over_the_size_cap_is_refused_unread() -> None:
    """Five megabytes is refused by its length, before any parsing."""
    with pytest.raises(Refused) as refused:
        decode(_entry("[1,0,0,0]", ',"pad":"' + "x" * (5 * 1024 * 1024) + '"'))
    assert refused.value.reason == "too_large"
    assert len(_entry("[1,0,0,0]")) < MAX_ENTRY_BYTES


def test_instances_the_reader_does_not_serve_are_skipped() -> None:
    """A peer's entry for an instance we do not have is dropped, the rest kept."""
    body = _entry("[2,10,0,0]").replace(b'"loads":{', b'"loads":{"zz":[5,0,0,0],')
    entry = decode(body, known={"a"})
    assert set(entry.share.loads) == {"a"}
    assert entry.share.loads["a"] == PeerLoad(2, 10, 0, 0)


@pytest.mark.parametrize(
    "speeds", ['{"a":[null,0,0,5]}', '{"a":[0,3,null,0]}', '{"a":[-1,3,null,0]}']
)
def test_a_speed_that_is_not_positive_refuses_the_entry(speeds: str) -> None:
    """A zero or negative learned speed (a division by zero in the health round, before)
    refuses the entry at the seam."""
    body = _entry("[1,0,0,0]").replace(b'"speeds":{}', b'"speeds":' + speeds.encode())
    with pytest.raises(Refused) as refused:
        decode(body)
    assert refused.value.reason == "out_of_bounds"


def test_an_entry_or_placements_nested_past_the_stack_are_refused_as_malformed() -> None:
    """200 KB of brackets (under the size cap) raised RecursionError, which the reader did
    not catch: the listener died and sharing went down while the entry stayed."""
    nested = b"[" * 100_000 + b"]" * 100_000
    assert len(nested) < MAX_ENTRY_BYTES
    for parse in (decode, parse_placements):
        with pytest.raises(Refused) as refused:
            parse(nested)
        assert refused.value.reason == "malformed"


def test_each_keys_queue_and_service_travel_and_sum() -> None:
    """Fair share's counts per key survive the codec and add up over the peers; a
    publication from before fair share has none."""
    share = LocalShare({}, {}, {}, key_queued={"a": 3}, key_service={"a": 10.0, "b": 2.5})
    entry = decode(encode(share, 0, 0))
    assert entry.share.key_queued == {"a": 3}
    assert entry.share.key_service == {"a": 10.0, "b": 2.5}
    view = combine([entry, entry])
    assert view.key_queued == {"a": 6}
    assert view.key_service == {"a": 20.0, "b": 5.0}
    assert decode(_entry("[1,0,0,0]")).share.key_service == {}


@pytest.mark.parametrize(
    "keys",
    [
        '{"a":[-1,0]}',
        '{"a":[0,Infinity]}',
        '{"a":[0,1e30]}',
        '{"' + "k" * 65 + '":[1,0]}',
        "{" + ",".join(f'"k{i}":[1,0]' for i in range(4097)) + "}",
        "[1,2]",
    ],
)
def test_a_key_count_no_peer_could_hold_refuses_the_entry(keys: str) -> None:
    with pytest.raises(Refused) as refused:
        decode(_entry("[1,0,0,0]", ',"keys":' + keys))
    assert refused.value.reason in ("out_of_bounds", "malformed")
