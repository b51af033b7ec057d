"""The `kv` benchmark's tables and target verdicts (see kv_bench.py)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from loadtest.report import Summary, ms_of, read, table, verdict
from loadtest.scenarios import say

EXACT, APPROX = "exact", "approx"
REPEAT = APPROX + "#2"  # uniform's second approx run: the A/A pair
INDEX_CASES = ("evict", "bypass", "replicas", "restart")  # where the estimate is judged
FASTER_CASES = ("evict", "bypass")  # where exact's p90 TTFT is judged against approx's
ESTIMATE_BAR = 0.02
P90_FACTOR = 0.7
COST_BAR = 1.1


def _rate(value: dict[str, Any] | None) -> str:
    rate = None if value is None else value.get("hit_rate")
    return "-" if rate is None else f"{rate:.3f}"


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def index_states(s: Summary) -> str:
    """Every instance's index state over the arm's gateways at the end: `whole x4`."""
    states = Counter(state for g in s["index"]["gateways"] for state in g["kv"]["state"].values())
    return ", ".join(f"{k} x{n}" for k, n in sorted(states.items())) or "-"


def _kv_sum(s: Summary, key: str) -> str:
    gateways = s["index"]["gateways"]
    if not any(g["kv"]["state"] for g in gateways):
        return "-"
    return str(sum(g["kv"][key] for g in gateways))


def case_table(runs: dict[str, Summary]) -> str:
    """Per arm: requests, the true and estimated hit rates, TTFT, throughput, the index."""
    headers = ["arm", "ok/req", "true hit", "gw est.", "|err|", "ttft p50", "p90", "p99",
               "tok/s", "index at the end", "gaps", "replays"]  # fmt: skip
    rows = []
    for name, s in runs.items():
        t = s["ttft_s"]
        index = s["index"]
        rows.append(
            [
                name,
                f"{s['ok']}/{s['requests']}",
                _rate(index["true"]),
                _rate(index["estimated"]),
                _num(index["error"]),
                ms_of(t, "p50"),
                ms_of(t, "p90"),
                ms_of(t, "p99"),
                f"{s['output_tokens_per_s']:.0f}",
                index_states(s),
                _kv_sum(s, "gaps"),
                _kv_sum(s, "replays"),
            ]
        )
    note = "times in ms; true hit: what the instances found cached for the front's requests"
    return table(headers, rows) + f"\n({note})"


def _restart_lines(runs: dict[str, Summary]) -> list[str]:
    lines = []
    for name, s in runs.items():
        r = s.get("restart")
        if r is None:
            continue
        before, after = r["before"], r["after"]
        lines.append(
            f"{name}: restarted at {r['at_s']:.0f} s, {r['gap_s']:.1f} s to ready; "
            f"before: true {_rate(before['true'])} est. {_rate(before['estimated'])}; "
            f"after: true {_rate(after['true'])} est. {_rate(after['estimated'])} "
            f"|err| {_num(after['error'])}; failed {s['requests'] - s['ok']}"
        )
    return lines


def _bypass_lines(case: dict[str, Any]) -> list[str]:
    lines = []
    for name, s in case["runs"].items():
        b = s.get("bypassed")
        if b is not None:
            lines.append(
                f"{name}: {b['ok']}/{b['requests']} bypassed, their ttft p50 "
                f"{ms_of(b['ttft_s'], 'p50')} p90 {ms_of(b['ttft_s'], 'p90')} ms"
            )
    runs = case["runs"]
    if runs and all(s["index"]["true"] is None for s in runs.values()):
        lines.append(
            "the instances' counters hold the bypassed requests too, and their answers do"
            " not say what was cached: no true hit rate for the requests through the front"
        )
    return lines


def cost_table(cost: dict[str, Any]) -> str:
    rows = [
        [arm, f"{per:.3f}", " ".join(f"{c:.2f}/{n}" for c, n in cost["rounds"][arm])]
        for arm, per in cost["cpu_ms_per_request"].items()
    ]
    text = table(["arm", "CPU ms/request", "rounds (CPU s/requests)"], rows)
    ratio = cost["exact_over_approx"]
    return text + f"\nexact / approx: {_num(ratio)}"


def print_case(name: str, case: dict[str, Any]) -> None:
    say(f"\n== {name} ==")
    if name == "cost":
        say(cost_table(case))
        return
    say(case_table(case["runs"]))
    for line in _restart_lines(case["runs"]) + _bypass_lines(case):
        say(line)


def _verdict(
    target: str, case: str, measured: float | None, bar: float | None, at_most: bool, **more: Any
) -> dict[str, Any]:
    return verdict(target, measured, bar, at_most, case=case, **more)


_read = read


def _p90(s: Summary) -> Any:
    return s["ttft_s"]["p90"]


def _tps(s: Summary) -> Any:
    return s["output_tokens_per_s"]


def _error(case: str) -> Callable[[Summary], Any]:
    """The estimate's error judged in `case`: after the restart in `restart` (the whole run
    would dilute it with the first life's), over the whole run elsewhere."""
    if case == "restart":
        return lambda s: s["restart"]["after"]["error"]
    return lambda s: s["index"]["error"]


def _floor(runs: dict[str, Summary], read: Callable[[Summary], Any], noise: float) -> float:
    """The noise floor of a figure: the A/A spread of approx's two runs, at least `noise`."""
    a, b = _read(runs, APPROX, read), _read(runs, REPEAT, read)
    if not a or b is None:
        return noise
    return max(noise, float(abs(b - a) / a))


def _approx_mean(runs: dict[str, Summary], read: Callable[[Summary], Any]) -> float | None:
    values = [v for v in (_read(runs, APPROX, read), _read(runs, REPEAT, read)) if v is not None]
    return sum(values) / len(values) if values else None


def verdicts(cases: dict[str, Any], noise: float) -> list[dict[str, Any]]:
    """Issue 43's targets, each with what was measured, the bar and whether it was met."""
    out: list[dict[str, Any]] = []
    for case in INDEX_CASES:
        if case in cases:
            runs = cases[case]["runs"]
            out.append(
                _verdict(
                    f"exact: |estimated - true hit rate| <= {ESTIMATE_BAR}",
                    case,
                    _read(runs, EXACT, _error(case)),
                    ESTIMATE_BAR,
                    True,
                )
            )
    for case in FASTER_CASES:
        if case in cases:
            runs = cases[case]["runs"]
            approx = _read(runs, APPROX, _p90)
            out.append(
                _verdict(
                    f"exact: p90 TTFT <= {P90_FACTOR} x approx's",
                    case,
                    _read(runs, EXACT, _p90),
                    None if approx is None else P90_FACTOR * approx,
                    True,
                )
            )
    if "uniform" in cases:
        runs = cases["uniform"]["runs"]
        for name, read, sign in (("p90 TTFT", _p90, 1), ("tok/s", _tps, -1)):
            floor = _floor(runs, read, noise)
            mean = _approx_mean(runs, read)
            out.append(
                _verdict(
                    f"exact: {name} {'<=' if sign > 0 else '>='} approx's within the noise floor",
                    "uniform",
                    _read(runs, EXACT, read),
                    None if mean is None else mean * (1 + sign * floor),
                    sign > 0,
                    floor=floor,
                )
            )
    if "cost" in cases:
        ratio = cases["cost"]["exact_over_approx"]
        out.append(
            _verdict(f"CPU per request exact / approx <= {COST_BAR}", "cost", ratio, COST_BAR, True)
        )
    return out
