"""What one gateway process publishes for the others, and how the others' are summed."""

from __future__ import annotations

import random

import pytest

from gateway.dispatch import STRATEGIES, InstanceSpec, Lane, Limits, Scheduler, Ticket
from gateway.shared import combine, decode, encode, redacted

FAR = 1e9


def make(*specs: InstanceSpec) -> Scheduler:
    sched = Scheduler(list(specs), STRATEGIES["least_busy"](30.0), Limits())
    for state in sched.states:
        sched.probe(state.name, True, 0.0, random.Random(0))
    return sched


def test_publications_round_trip_and_sum() -> None:
    """encode/decode keep a publication whole; combine sums loads and queues, keeps speeds."""
    rng = random.Random(0)
    sched = make(InstanceSpec("a"), InstanceSpec("b"))
    sched.submit(Ticket(1, Lane.SHORT, FAR, tokens=40), 0.0, rng)
    sched.state("a").speed.observe_tpot(0.02)
    entry = decode(encode(sched.share(), 12, 3))
    assert entry.share == sched.share()
    assert (entry.requests, entry.retries) == (12, 3)
    view = combine([entry, entry])
    assert view.peers == 2
    assert sum(load.inflight for load in view.loads.values()) == 2
    assert len(view.speeds["a"]) == 2


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
