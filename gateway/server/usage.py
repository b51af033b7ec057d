"""What `GET /admin/usage` shows: each configured key's use since start, its limits, and
what is left of them now.

The use is read from the key counters of /metrics (`gateway_key_requests_total`, whose
outcomes tell a request the gateway turned away, `refused`, from one that failed, `error`;
`gateway_key_tokens_total`, and fair share's `gateway_key_service_total`), so the page
and Prometheus never disagree: this process's, or with `--workers` every worker's merged.
What is left comes from where the limits are counted: Redis with `[shared]` (fleet-wide),
else this process.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client.core import Metric

from gateway.dispatch.key_limits import Standing, Standings
from gateway.proxy.tenants import Tenant

_COUNTERS = ("gateway_key_requests", "gateway_key_tokens")


def key_use(families: Iterable[Metric]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per key, per model: requests by outcome, and prompt and completion tokens."""
    use: dict[str, dict[str, dict[str, Any]]] = {}
    for family in families:
        if family.name not in _COUNTERS:
            continue
        for sample in family.samples:
            if not sample.name.endswith("_total") or not sample.value:
                continue
            labels = sample.labels
            model = use.setdefault(labels["key"], {}).setdefault(
                labels["model"], {"requests": {}, "prompt_tokens": 0, "completion_tokens": 0}
            )
            if family.name == "gateway_key_requests":
                model["requests"][labels["outcome"]] = int(sample.value)
            else:
                model[f"{labels['kind']}_tokens"] = int(sample.value)
    return use


def key_service(families: Iterable[Metric]) -> dict[str, float]:
    """Per key, the weighted tokens fair share counted (fairness.py)."""
    for family in families:
        if family.name == "gateway_key_service":
            return {s.labels["key"]: s.value for s in family.samples if s.name.endswith("_total")}
    return {}


def started_at(families: Iterable[Metric]) -> float | None:
    """When the process (the earliest worker) started, as /metrics says."""
    for family in families:
        if family.name == "process_start_time_seconds" and family.samples:
            return float(family.samples[0].value)
    return None


def report(
    tenants: Iterable[Tenant],
    families: Iterable[Metric],
    standings: Mapping[str, tuple[Standings, str]],
) -> dict[str, Any]:
    """The page: each key in configuration order, with its use since the process started,
    its limits and what is left (and where that was counted: `redis` or `process`)."""
    families = list(families)
    use = key_use(families)
    service = key_service(families)
    keys = []
    for tenant in tenants:
        limits = tenant.limits
        entry: dict[str, Any] = {
            "name": tenant.name,
            "models": None if tenant.models is None else sorted(tenant.models),
            "priority": tenant.priority.value,
            "share": tenant.share,
            "service": service.get(tenant.name, 0.0),
            "limits": {
                "requests_per_minute": limits.requests_per_minute,
                "tokens_per_minute": limits.tokens_per_minute,
                "max_concurrent": limits.max_concurrent,
            },
            "usage": use.get(tenant.name, {}),
        }
        if tenant.name in standings:
            now, counted_in = standings[tenant.name]
            entry["remaining"] = {
                "requests": _left(now.requests),
                "tokens": _left(now.tokens),
                "concurrent": _left(now.concurrent),
                "counted_in": counted_in,
            }
        keys.append(entry)
    return {"since": started_at(families), "keys": keys}


def _left(standing: Standing | None) -> dict[str, Any] | None:
    if standing is None:
        return None
    return {"remaining": standing.remaining, "reset_s": round(standing.reset, 3)}
