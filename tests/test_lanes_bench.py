"""The `lanes` sittings' parts (loadtest/lanes/bench.py): setups, their settings, the
requests that missed goodput."""

from __future__ import annotations

import pytest

from loadtest.lanes import bench, targets
from loadtest.loadgen import Result


def test_setup_flags_become_config_sections() -> None:
    """`queue_all` lifts the queue wait past any run; `cap1` allows one long prefill per
    instance; `cardqN` sets the cards' queue; flags of one section merge; no flag leaves
    the gateway's defaults."""
    assert bench.settings(set()) == {}
    assert bench.settings({"cap1"}) == {"prefill": {"max_long_per_instance": 1}}
    assert bench.settings({"cap1", "queue_all"}) == {
        "prefill": {"max_long_per_instance": 1},
        "dispatch": {"max_queue_wait": bench.QUEUE_ALL},
    }
    assert bench.settings({"cardq0"}) == {"dispatch": {"max_queue_per_instance": 0}}
    assert bench.settings({"cardq4", "queue_all"}) == {
        "dispatch": {"max_queue_per_instance": 4, "max_queue_wait": bench.QUEUE_ALL},
    }


def test_a_setup_names_its_strategy_flags_and_ref() -> None:
    """`strategy:flag+flag@ref` splits into its parts; a bare name has no flag and no ref;
    an unknown flag is an error naming it."""
    assert bench.parse_setup("least_busy:queue_all+cap1@ae9739e") == (
        "least_busy",
        {"queue_all", "cap1"},
        "ae9739e",
    )
    assert bench.parse_setup("least_time") == ("least_time", set(), None)
    with pytest.raises(ValueError, match=r"\['bogus'\] in 'least_time:bogus' \(known: cap1,"):
        bench.parse_setup("least_time:bogus")


def test_a_repeated_gateway_setup_is_the_same_setup() -> None:
    assert bench.parse_setup("least_time:queue_all+cap1@abc#2") == (
        "least_time",
        {"queue_all", "cap1"},
        "abc",
    )
    assert targets.front("nginx#2") == "nginx"
    assert not targets.is_repeat("nginx")


def test_missed_goodput_is_split_by_class_and_objective() -> None:
    """Each request out of goodput counts once, in its class, under the objective it missed
    (or both, or failed); requests within both objectives count nowhere."""
    results = [
        Result(0, long=False, sent=0.0, status=200, ttft=0.1, tpot=0.01),  # good
        Result(1, long=False, sent=0.0, status=200, ttft=2.0, tpot=0.01),  # late
        Result(2, long=True, sent=0.0, status=200, ttft=0.5, tpot=0.09),  # slow
        Result(3, long=True, sent=0.0, status=200, ttft=1.5, tpot=0.09),  # both
        Result(4, long=True, sent=0.0, status=429),  # refused
    ]
    assert bench.missed_objectives(results, 1.0, 0.05) == {
        "short": {"failed": 0, "ttft": 1, "tpot": 0, "both": 0},
        "long": {"failed": 1, "ttft": 0, "tpot": 1, "both": 1},
    }
