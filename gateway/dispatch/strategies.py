"""The strategies by name, as `[dispatch] strategy` names them."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from .least_time import LeastTime
from .model import Lane
from .select import LeastBusy, RoundRobin

Strategy = LeastBusy | RoundRobin | LeastTime
# Every strategy is built as Strategy(metrics_stale_after, tpot_objectives_by_lane).
STRATEGIES: dict[str, Callable[[float, Mapping[Lane, float] | None], Strategy]] = {
    "least_busy": LeastBusy,
    "least_time": LeastTime,
    "round_robin": RoundRobin,
}
