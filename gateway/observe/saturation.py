"""Fleet saturation by model: the one number an autoscaler needs, from a scheduler snapshot.

    saturation(model) = (waiting in the gateway for the model
                         + requests at the instances that serve it, running or queued there)
                        / running slots of those instances

over the instances that take traffic now (up, not ejected, not drained). Below 1 the
fleet has idle slots; 1 is every slot busy; above 1 requests wait, in the gateway or at
the instances. An instance whose model list is not known yet counts for every model (the
scheduler may place any model there too); one serving several models counts its whole
load for each, since the models share its slots.

A request at an instance is counted from both sides, the larger winning: the instance's
fresh scrape (`num_requests_running` + `num_requests_waiting`, which also sees traffic
that does not pass through this gateway) and what this gateway and its peers placed there
(instant, where the scrape is up to a health round old). Without a fresh scrape, ours only.

No slot up for a model: +Inf while requests wait for it (scale up: nothing can serve
them), 0 while none do.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from gateway.dispatch import Snapshot
from gateway.dispatch.snapshot import InstanceSnapshot


def slots_of(instance: InstanceSnapshot) -> int:
    """The running slots the scheduler places by: configured, or fewer once learned."""
    learned = instance.learned_slots
    return instance.slots if learned is None else min(learned, instance.slots)


def load_of(instance: InstanceSnapshot) -> float:
    """Requests at the instance, running or waiting there (see the module's docstring)."""
    placed = float(instance.inflight + instance.peers_inflight)
    report = instance.fresh_report
    if report is None:
        return placed
    return max(placed, report.running + report.waiting)


def fleet_saturation(snap: Snapshot) -> Mapping[str, float]:
    """Each model's saturation: the models the instances list and those requests wait for."""
    up = snap.up()
    models = set(snap.model_queued)
    for instance in snap.instances:
        models |= instance.models or frozenset()
    out = {}
    for model in sorted(models):
        serving = [i for i in up if i.models is None or model in i.models]
        capacity = sum(slots_of(i) for i in serving)
        demand = snap.model_queued.get(model, 0) + sum(load_of(i) for i in serving)
        if capacity > 0:
            out[model] = demand / capacity
        else:
            out[model] = math.inf if demand > 0 else 0.0
    return out
