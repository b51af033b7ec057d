"""Pure parts of the priority benchmark: each arm's gateway settings and the targets."""

from __future__ import annotations

from typing import Any

from loadtest import priority


def test_arms_differ_only_in_classes() -> None:
    """ "classes" marks chat interactive, jobs batch and the instances priority; "no classes"
    names the same keys with none of it."""
    tenants = priority.PriorityOptions().tenants()
    plain = priority._arm_config("no classes", tenants)
    classes = priority._arm_config("classes", tenants)
    assert [k["name"] for k in plain["channel"]["keys"]] == ["chat", "jobs"]
    assert [k["priority"] for k in classes["channel"]["keys"]] == ["interactive", "batch"]
    assert classes["instance_fields"] == {"scheduling_policy": "priority"}
    assert plain["instance_fields"] == {}
    assert plain["extra"] == {}
    assert classes["extra"]["slo.batch"]["ttft"] == 30.0


def arm(chat: dict[str, Any], jobs: dict[str, Any]) -> dict[str, Any]:
    base = {"sent": 100, "status_429": 0, "status_503": 0, "ttft_p99_s": 0.5, "goodput_rps": 1.0}
    return {"classes": {"interactive": {**base, **chat}, "batch": {**base, **jobs}}}


def test_targets() -> None:
    """Met when interactive's p99 is within its objective, batch has the refusals (and
    interactive at most 1%) and batch has goodput; each missed on its own."""
    assert all(priority.targets(arm({}, {"status_429": 40}), 1.0).values())
    missed = priority.targets(arm({"ttft_p99_s": 1.5, "status_503": 2}, {"goodput_rps": 0}), 1.0)
    assert not any(missed.values())
    assert not priority.targets(arm({"ttft_p99_s": None}, {}), 1.0)[
        "interactive_p99_ttft_within_objective"
    ]
