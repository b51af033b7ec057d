"""The fleet a scheduler dispatches to: its instances, by name and by lane.

`Fleet` is the scheduler's base: it holds the instance states and answers questions
about them; `set_fleet` swaps in a new instance list (a reload) and keeps the state of
the instances that stay.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .affinity import PrefixIndex
from .model import HealthPolicy, InstanceSpec, InstanceState, Lane, Limits


class Fleet:
    states: list[InstanceState]
    limits: Limits
    health_policy: HealthPolicy

    def __init__(
        self, specs: Sequence[InstanceSpec], limits: Limits, health_policy: HealthPolicy
    ) -> None:
        self._by_name: dict[str, InstanceState] = {}
        self.set_fleet(specs, limits, health_policy)

    def set_fleet(
        self,
        specs: Sequence[InstanceSpec],
        limits: Limits,
        health_policy: HealthPolicy,
        departed: Mapping[str, InstanceState] | None = None,
    ) -> None:
        """Instances by name: one already here keeps its state with its new spec.

        `departed` are removed instances that still hold requests: one added back gets
        its state back, so its in-flight count stays exact.
        """
        if not specs:
            raise ValueError("a scheduler needs at least one instance")
        states = []
        for spec in specs:
            state = self._by_name.get(spec.name) or (departed or {}).get(spec.name)
            if state is None:
                state = InstanceState(spec)
                state.cache = PrefixIndex(limits.prefix_index_blocks)
            state.spec = spec
            states.append(state)
        self.states = states
        self.limits = limits
        self.health_policy = health_policy
        self._by_name = {s.name: s for s in states}
        # Where a lane has no dedicated or shared instance, it may use any.
        self._pool = {lane: [s for s in states if s.serves(lane)] or states for lane in Lane}

    def state(self, name: str) -> InstanceState:
        return self._by_name[name]

    def has(self, name: str) -> bool:
        """Whether `name` is in the fleet (a reload may have removed it since)."""
        return name in self._by_name

    def any_available(self, now: float) -> bool:
        return any(s.available(now) for s in self.states)

    def model_served(self, model: str) -> bool:
        """Whether any instance, up or down, may serve `model` (unknown lists count as yes)."""
        return any(s.serves_model(model) for s in self.states)

    def knows_model(self, model: str) -> bool:
        """Whether some instance is known to serve `model` (bounds the metrics' model label)."""
        return any(s.models is not None and model in s.models for s in self.states)

    def served_models(self) -> list[str]:
        """Every model some instance is known to serve, sorted."""
        return sorted({m for s in self.states for m in s.models or ()})

    def _alive(self, lane: Lane, model: str | None, now: float) -> bool:
        return any(s.available(now) and s.serves_model(model) for s in self._pool[lane])
