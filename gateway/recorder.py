"""After the fact: one access-log line and the metrics of each finished request.

Also the SLO accounting: a finished stream is counted against its lane's objectives for
time to first token and time per output token, and as goodput when it met both.
"""

from __future__ import annotations

from . import log
from .metrics import Metrics
from .relay import Exchange

_access = log.get("gateway.access")


class Recorder:
    def __init__(self, metrics: Metrics, slo: dict[str, tuple[float, float]]) -> None:
        self.metrics = metrics
        self.slo = slo  # lane name -> (ttft objective, tpot objective), seconds

    def _account_slo(self, ex: Exchange, lane: str) -> None:
        """Count a finished stream against its lane's TTFT and TPOT objectives."""
        assert ex.ttft is not None
        assert ex.tpot is not None
        ttft_goal, tpot_goal = self.slo[lane]
        ttft_ok, tpot_ok = ex.ttft <= ttft_goal, ex.tpot <= tpot_goal
        slo = self.metrics.slo
        slo.labels(lane, ex.instance, "ttft", "met" if ttft_ok else "missed").inc()
        slo.labels(lane, ex.instance, "tpot", "met" if tpot_ok else "missed").inc()
        if ttft_ok and tpot_ok:
            self.metrics.goodput.labels(lane, ex.instance).inc()

    def record(self, ex: Exchange, duration: float) -> None:
        lane = ex.lane or "none"
        self.metrics.requests.labels(
            ex.route,
            str(ex.status),
            lane,
            ex.model or "none",
            self.metrics.tag_label(ex.tag or "none"),
        ).inc()
        if ex.instance:
            self.metrics.duration.labels(lane).observe(duration)
        if ex.ttft is not None:
            self.metrics.ttft.labels(lane).observe(ex.ttft)
            if ex.tpot is not None:
                self._account_slo(ex, lane)
        _access.info(
            "request",
            route=ex.route,
            status=ex.status,
            model=ex.model or None,
            instance=ex.instance or None,
            lane=ex.lane or None,
            attempts=ex.attempts,
            duration_ms=round(duration * 1000, 2),
            ttft_ms=None if ex.ttft is None else round(ex.ttft * 1000, 2),
            tokens=ex.tokens,
        )
