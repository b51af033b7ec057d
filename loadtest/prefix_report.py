"""The `prefix` benchmark's tables, target verdicts and plots (see prefix_bench.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from loadtest.report import Summary, _pyplot, ms, read, table, verdict
from loadtest.scenarios import say

OURS = "least_time"


def _hit(s: Summary) -> str:
    rate = s["cache"]["hit_rate"]
    return "-" if rate is None else f"{rate:.2f}"


def _estimate(s: Summary) -> str:
    """The gateway's own estimate of the hit rate (its index), where it keeps one."""
    rate = s["cache"].get("gateway_estimate", {}).get("hit_rate")
    return "-" if rate is None else f"{rate:.2f}"


def _per_instance(s: Summary, key: str) -> str:
    values = [v[key] for v in s["cache"]["instances"].values()]
    if key == "hit_rate":
        return " ".join("-" if v is None else f"{v:.2f}" for v in values)
    return " ".join(str(v) for v in values)


def scenario_table(runs: dict[str, Summary]) -> str:
    """Per setup: requests, hit rate (fleet and per instance), TTFT, throughput, goodput."""
    headers = [
        "setup",
        "ok/req",
        "hit rate",
        "gw est.",
        "per instance",
        "requests per instance",
        "ttft p50",
        "p90",
        "p99",
        "tok/s",
        "steady tok/s",
        "goodput",
    ]
    rows = []
    for name, s in runs.items():
        t = s["ttft_s"]
        rows.append(
            [
                name,
                f"{s['ok']}/{s['requests']}",
                _hit(s),
                _estimate(s),
                _per_instance(s, "hit_rate"),
                _per_instance(s, "requests"),
                ms(t["p50"]),
                ms(t["p90"]),
                ms(t["p99"]),
                f"{s['output_tokens_per_s']:.0f}",
                f"{s['window_output_tokens_per_s']:.0f}",
                f"{s['goodput_rps']:.1f}",
            ]
        )
    return table(headers, rows) + "\n(times in ms; instances in fleet order, #3 last)"


def print_scenario(name: str, scenario: dict[str, Any]) -> None:
    say(f"\n== {name} ==")
    say(scenario_table(scenario["runs"]))


def _check(
    target: str, scenario: str, measured: float | None, bar: float | None, at_most: bool
) -> dict[str, Any]:
    return verdict(target, measured, bar, at_most, scenario=scenario)


_get = read


def _times(value: Any, factor: float) -> float | None:
    return None if value is None else value * factor


def verdicts(scenarios: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 9's targets, each with what was measured, the bar and whether it was met."""
    out: list[dict[str, Any]] = []
    p50: Callable[[Summary], Any] = lambda s: s["ttft_s"]["p50"]  # noqa: E731
    p99: Callable[[Summary], Any] = lambda s: s["ttft_s"]["p99"]  # noqa: E731
    tps: Callable[[Summary], Any] = lambda s: s["output_tokens_per_s"]  # noqa: E731
    hit: Callable[[Summary], Any] = lambda s: s["cache"]["hit_rate"]  # noqa: E731
    if "uniform" in scenarios:
        runs = scenarios["uniform"]["runs"]
        out.append(_check("hit rate >= 0.9", "uniform", _get(runs, OURS, hit), 0.9, False))
        for name, read in (("p50", p50), ("p99", p99)):
            out.append(
                _check(
                    f"{name} TTFT <= sticky's",
                    "uniform",
                    _get(runs, OURS, read),
                    _get(runs, "sticky", read),
                    True,
                )
            )
    if "zipf" in scenarios:
        runs = scenarios["zipf"]["runs"]
        sticky_p99 = _times(_get(runs, "sticky", p99), 0.5)
        out.append(
            _check("p99 TTFT <= 0.5 x sticky's", "zipf", _get(runs, OURS, p99), sticky_p99, True)
        )
        out.append(
            _check(
                "tok/s >= sticky's", "zipf", _get(runs, OURS, tps), _get(runs, "sticky", tps), False
            )
        )
    if "saturation" in scenarios:
        runs = scenarios["saturation"]["runs"]
        bar = _times(_get(runs, "round_robin", tps), 2.0)
        out.append(
            _check("tok/s >= 2.0 x round_robin's", "saturation", _get(runs, OURS, tps), bar, False)
        )
    if "conversations" in scenarios:
        runs = scenarios["conversations"]["runs"]
        bar = _times(_get(runs, "least_busy/no-affinity", tps), 1.3)
        for ours in ("least_busy", OURS):
            out.append(
                _check(
                    f"{ours} tok/s >= 1.3 x least_busy/no-affinity's",
                    "conversations",
                    _get(runs, ours, tps),
                    bar,
                    False,
                )
            )
    if "even" in scenarios:
        runs = scenarios["even"]["runs"]
        off = f"{OURS}/no-affinity"
        out.append(
            _check(
                "tok/s >= 0.95 x affinity off",
                "even",
                _get(runs, OURS, tps),
                _times(_get(runs, off, tps), 0.95),
                False,
            )
        )
        out.append(
            _check(
                "p99 TTFT <= 1.05 x affinity off",
                "even",
                _get(runs, OURS, p99),
                _times(_get(runs, off, p99), 1.05),
                True,
            )
        )
    return out


def plot_cdf(scenarios: dict[str, Any], path: Path) -> None:
    """TTFT CDF per setup, one panel per scenario (log time axis)."""
    plt = _pyplot()
    names = list(scenarios)
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.6), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        for setup, s in scenarios[name]["runs"].items():
            q = s["ttft_quantiles_s"]
            if q:
                ax.plot(q, [i / (len(q) - 1) for i in range(len(q))], label=setup)
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (s)")
        ax.set_title(name, fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("share of requests")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_hits(scenarios: dict[str, Any], path: Path) -> None:
    """Prefix-cache hit rate per instance, bars grouped by setup, one panel per scenario."""
    plt = _pyplot()
    names = [n for n in scenarios if scenarios[n]["cache_blocks"]]
    if not names:
        return
    fig, axes = plt.subplots(1, len(names), figsize=(4.6 * len(names), 3.6), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        runs = scenarios[name]["runs"]
        for col, s in enumerate(runs.values()):
            rates = [v["hit_rate"] or 0.0 for v in s["cache"]["instances"].values()]
            width = 0.8 / max(1, len(rates))
            for i, rate in enumerate(rates):
                ax.bar(col + (i - (len(rates) - 1) / 2) * width, rate, width, color=f"C{i}")
        ax.set_xticks(range(len(runs)), list(runs), rotation=30, ha="right", fontsize=7)
        ax.set_ylim(0, 1)
        ax.set_title(f"{name}: hit rate per instance (#0..#3)", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
