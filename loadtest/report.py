"""Turn runs into numbers: percentiles, throughput, goodput, shares; tables, and whether
matplotlib is there to plot them (the scenarios' plots: report_plots.py and plots.py).

A summary is a plain JSON-able dict, so scenarios can print it, write it, and tests can
check that it adds up. Throughput and goodput divide by the run's span, from its start
until its last answer (the drain of a backlog counts, as it does for the users waiting).
`window_output_tokens_per_s` counts only the tokens of requests finished before the last
request was sent, over that window: the steady state, without the drain.
"""

from __future__ import annotations

import importlib.util
import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from loadtest.loadgen import Result, Run

Summary = dict[str, Any]
PERCENTILES = (50, 90, 99)
# Below 100 / (100 - p) samples the nearest-rank p-th percentile is just the maximum:
# 99 of 50 requests is no p99, so it is not reported (None, "n/a" in tables and plots).
MIN_SAMPLES = {50: 1, 90: 10, 99: 100}


def percentiles(values: Iterable[float]) -> dict[str, float | None]:
    """Nearest-rank p50/p90/p99, max, mean and the sample count `n`.

    A percentile is None when there are fewer than MIN_SAMPLES values for it (all are
    None with no values).
    """
    ordered = sorted(values)
    out: dict[str, float | None] = {"n": len(ordered)}
    for p in PERCENTILES:
        enough = ordered and len(ordered) >= MIN_SAMPLES[p]
        out[f"p{p}"] = ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)] if enough else None
    out["max"] = ordered[-1] if ordered else None
    out["mean"] = sum(ordered) / len(ordered) if ordered else None
    return out


def too_few(stats: dict[str, Any], key: str) -> bool:
    """Whether `key` (e.g. "p99") is missing for want of samples, not for want of data."""
    return stats.get(key) is None and bool(stats.get("n"))


def meets(result: Result, ttft_slo: float, tpot_slo: float) -> bool:
    """Whether a request succeeded within both objectives (a 1-token answer has no TPOT)."""
    if not result.ok or result.ttft is None or result.ttft > ttft_slo:
        return False
    return result.tpot is None or result.tpot <= tpot_slo


def summarize(run: Run, *, ttft_slo: float, tpot_slo: float) -> Summary:
    """Everything a report shows about one run."""
    results = run.results
    ok = [r for r in results if r.ok]
    duration = run.duration
    errors = Counter(r.error_key() for r in results if not r.ok)
    if run.unfinished:
        errors["unfinished"] = run.unfinished
    served = Counter(r.instance for r in ok)
    good = sum(1 for r in results if meets(r, ttft_slo, tpot_slo))
    window_end = run.started + run.window
    in_window = [r for r in ok if r.latency is not None and r.sent + r.latency <= window_end]
    return {
        "label": run.label,
        "requests": len(results) + run.unfinished,
        "completed": len(results),
        "ok": len(ok),
        "errors": dict(sorted(errors.items())),
        # Sent more than once (the client's retries): ok ones are timed from the first try.
        "retried": sum(1 for r in results if r.attempts > 1),
        "duration_s": duration,
        "requests_per_s": len(ok) / duration,
        "output_tokens_per_s": sum(r.tokens for r in ok) / duration,
        "goodput_rps": good / duration,
        "window_s": run.window,
        "window_output_tokens_per_s": sum(r.tokens for r in in_window) / run.window,
        "slo": {"ttft_s": ttft_slo, "tpot_s": tpot_slo},
        "met_slo": good,
        "ttft_s": percentiles(r.ttft for r in ok if r.ttft is not None),
        "tpot_s": percentiles(r.tpot for r in ok if r.tpot is not None),
        "latency_s": percentiles(r.latency for r in ok if r.latency is not None),
        "output_tokens": percentiles(float(r.tokens) for r in ok),
        "reads_per_stream": percentiles(float(r.reads) for r in ok),
        "long_requests": sum(1 for r in results if r.long),
        "long_ttft_s": percentiles(r.ttft for r in ok if r.long and r.ttft is not None),
        "instances": {
            name: {"requests": count, "share": count / len(ok)}
            for name, count in sorted(served.items())
        },
        "timeline": timeline(run),
    }


_BINS = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0)


def timeline(run: Run, most: int = 60) -> dict[str, Any]:
    """Answers per time bin, by when they finished: ok and failed requests, output tokens,
    and the median TTFT of the ok ones (None in a bin without any); at most `most` bins."""
    ends = [r.sent + (r.latency or 0.0) for r in run.results]
    if run.started > 0 or not ends:
        start, span = run.started, run.duration
    else:  # a run merged from several (started 0): its results' own span
        start = min(r.sent for r in run.results)
        span = max(1e-9, max(ends) - start)
    size = next((b for b in _BINS if span / b <= most), _BINS[-1])
    count = max(1, math.ceil(span / size))
    ok, failed, tokens = [0] * count, [0] * count, [0] * count
    ttfts: list[list[float]] = [[] for _ in range(count)]
    for r, end in zip(run.results, ends, strict=True):
        at = end - start
        i = min(count - 1, max(0, int(at / size)))
        if r.ok:
            ok[i] += 1
            tokens[i] += r.tokens
            if r.ttft is not None:
                ttfts[i].append(r.ttft)
        else:
            failed[i] += 1
    return {
        "bin_s": size,
        "ok": ok,
        "failed": failed,
        "output_tokens": tokens,
        "ttft_p50_s": [percentiles(t)["p50"] for t in ttfts],
    }


# --- text ---------------------------------------------------------------------------------


def verdict(
    target: str, measured: float | None, bar: float | None, at_most: bool, **where: Any
) -> dict[str, Any]:
    """A target's verdict: what was measured, the bar, and whether it was met (None when
    either is missing, so a run that did not measure it cannot pass it). `where` names the
    scenario or case it was judged in."""
    if measured is None or bar is None or math.isnan(measured) or math.isnan(bar):
        met = None
    else:
        met = measured <= bar if at_most else measured >= bar
    return {"target": target, **where, "measured": measured, "bar": bar, "met": met}


def read(runs: dict[str, Summary], name: str, value: Callable[[Summary], Any]) -> Any:
    """`value` of run `name`, or None where it did not run (a skipped baseline)."""
    return value(runs[name]) if name in runs else None


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def ms_of(stats: dict[str, Any], key: str) -> str:
    """A percentile in ms for a table: "n/a" where there are too few samples for it."""
    return "n/a" if too_few(stats, key) else ms(stats[key])


NA_NOTE = "n/a: too few samples for that percentile (p90 needs 10, p99 needs 100)"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain aligned text table (first column left, the rest right)."""
    widths = [max(len(str(row[i])) for row in [headers, *rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        parts = [
            str(c).ljust(w) if i == 0 else str(c).rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts)

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def shares_text(summary: Summary) -> str:
    instances = summary["instances"]
    return " ".join(f"{v['share']:.2f}" for v in instances.values()) or "-"


def run_table(summaries: Sequence[Summary]) -> str:
    """The full table: counts, latency percentiles (ms), throughput and goodput per run."""
    headers = [
        "run",
        "ok/req",
        "errors",
        "retried",
        "ttft p50",
        "p90",
        "p99",
        "max",
        "tpot p50",
        "p90",
        "p99",
        "e2e p50",
        "p99",
        "max",
        "req/s",
        "tok/s",
        "goodput",
    ]
    rows = []
    for s in summaries:
        t, p, e = s["ttft_s"], s["tpot_s"], s["latency_s"]
        errors = ",".join(f"{k}:{v}" for k, v in s["errors"].items()) or "-"
        rows.append(
            [
                s["label"],
                f"{s['ok']}/{s['requests']}",
                errors,
                str(s.get("retried", 0)),
                ms_of(t, "p50"),
                ms_of(t, "p90"),
                ms_of(t, "p99"),
                ms(t["max"]),
                ms_of(p, "p50"),
                ms_of(p, "p90"),
                ms_of(p, "p99"),
                ms_of(e, "p50"),
                ms_of(e, "p99"),
                ms(e["max"]),
                f"{s['requests_per_s']:.1f}",
                f"{s['output_tokens_per_s']:.0f}",
                f"{s['goodput_rps']:.1f}",
            ]
        )
    return table(headers, rows) + (
        "\n(times in ms; retried: sent more than once by the client, timed from its first"
        f" try; goodput: req/s meeting both SLOs; {NA_NOTE})"
    )


def seed_table(summaries: Sequence[Summary]) -> str:
    """The seed post's table (average and max latency, tok/s) plus p99 TTFT, goodput, shares."""
    headers = [
        "setup",
        "avg latency s",
        "max latency s",
        "tok/s",
        "steady tok/s",
        "p99 TTFT ms",
        "goodput req/s",
        "ok/req",
        "share per instance",
    ]
    rows = [
        [
            s["label"],
            "-" if s["latency_s"]["mean"] is None else f"{s['latency_s']['mean']:.2f}",
            "-" if s["latency_s"]["max"] is None else f"{s['latency_s']['max']:.2f}",
            f"{s['output_tokens_per_s']:.0f}",
            f"{s['window_output_tokens_per_s']:.0f}",
            ms_of(s["ttft_s"], "p99"),
            f"{s['goodput_rps']:.2f}",
            f"{s['ok']}/{s['requests']}",
            shares_text(s),
        ]
        for s in summaries
    ]
    return table(headers, rows) + f"\n({NA_NOTE})"


# --- plots --------------------------------------------------------------------------------


def can_plot() -> bool:
    """Whether matplotlib is installed (the `bench` extra); without it scenarios skip PNGs."""
    return importlib.util.find_spec("matplotlib") is not None


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
