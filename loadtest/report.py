"""Turn runs into numbers: percentiles, throughput, goodput, shares; tables and plots.

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
from pathlib import Path
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
    return table(headers, rows) + f"\n(times in ms; goodput: req/s meeting both SLOs; {NA_NOTE})"


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


def plot_sweep(points: Sequence[tuple[int, Summary]], path: Path, title: str) -> None:
    """TTFT and TPOT percentiles (ms) against concurrency, with each level's sample count,
    and the throughput at each level."""
    from loadtest.plots import n_of, value_or_nan

    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    xs = [c for c, _ in points]
    for ax, key, name in ((axes[0], "ttft_s", "TTFT"), (axes[1], "tpot_s", "TPOT")):
        for p, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
            ys = [value_or_nan(s[key], p, 1000) for _, s in points]
            thin = sum(1 for _, s in points if too_few(s[key], p))
            note = f" (n/a at {thin} of {len(points)}: n<{MIN_SAMPLES[int(p[1:])]})" if thin else ""
            ax.plot(xs, ys, style, label=p + note)
        for x, (_, s) in zip(xs, points, strict=True):
            ax.annotate(
                f"n={n_of(s[key])}",
                (x, 0),
                xycoords=("data", "axes fraction"),
                xytext=(0, 3),
                textcoords="offset points",
                ha="center",
                fontsize=7,
            )
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_title(name)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes[2]
    ax.plot(xs, [s["output_tokens_per_s"] for _, s in points], "o-", color="C2")
    ax.set_ylabel("output tokens/s", color="C2")
    rps = ax.twinx()
    rps.plot(xs, [s["requests_per_s"] for _, s in points], "s--", color="C4")
    rps.set_ylabel("requests/s", color="C4")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_title("throughput")
    ax.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_compare(groups: Sequence[tuple[str, Sequence[Summary]]], path: Path, title: str) -> None:
    """Per group of runs (one per load shape): tok/s, p99 TTFT (n=, or n/a with too few
    samples) and goodput, one bar per run; and each run's tokens/s over time."""
    from loadtest.plots import n_of, throughput_panel

    plt = _pyplot()
    metrics: tuple[tuple[str, Callable[[Summary], float]], ...] = (
        ("output tokens/s", lambda s: s["output_tokens_per_s"]),
        ("p99 TTFT (s)", lambda s: s["ttft_s"]["p99"] or math.nan),
        ("goodput (req/s)", lambda s: s["goodput_rps"]),
    )
    fig, axes = plt.subplots(len(groups), 4, figsize=(16, 3.6 * len(groups)), squeeze=False)
    for row, (name, summaries) in enumerate(groups):
        labels = [s["label"] for s in summaries]
        for col, (metric, get) in enumerate(metrics):
            ax = axes[row][col]
            ax.bar(range(len(labels)), [get(s) for s in summaries], color=f"C{col}")
            ax.set_xticks(range(len(labels)), labels, rotation=15, fontsize=8)
            ax.set_title(f"{name}: {metric}", fontsize=9)
            ax.grid(True, axis="y", alpha=0.3)
            if metric.startswith("p99"):
                for x, s in enumerate(summaries):
                    n = n_of(s["ttft_s"])
                    text = f"n/a\n(n={n}<100)" if too_few(s["ttft_s"], "p99") else f"n={n}"
                    ax.annotate(
                        text,
                        (x, 0),
                        xycoords=("data", "axes fraction"),
                        xytext=(0, 3),
                        textcoords="offset points",
                        ha="center",
                        fontsize=7,
                    )
        throughput_panel(axes[row][3], summaries)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ladder(
    ladder: dict[str, dict[str, Summary]], setups: Sequence[str], path: Path, capacity: float
) -> None:
    """SLO attainment, p99 TTFT (n/a with too few samples) and tok/s against offered load,
    one line per setup; the legend gives each setup's sample counts."""
    plt = _pyplot()
    loads = sorted(ladder, key=float)
    xs = [float(load) * capacity for load in loads]
    panels: tuple[tuple[str, Callable[[Summary], float]], ...] = (
        ("share of requests within both SLOs", lambda s: s["met_slo"] / max(1, s["requests"])),
        ("p99 TTFT (s)", lambda s: s["ttft_s"]["p99"] or math.nan),
        ("output tokens/s", lambda s: s["output_tokens_per_s"]),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(13, 3.8))
    for ax, (name, get) in zip(axes, panels, strict=True):
        for setup in setups:
            counts = "/".join(str(ladder[load][setup]["ttft_s"].get("n", 0)) for load in loads)
            ax.plot(
                xs,
                [get(ladder[load][setup]) for load in loads],
                "o-",
                label=f"{setup} (n={counts})",
            )
        ax.set_xlabel("offered load (req/s)")
        ax.set_title(name, fontsize=9)
        ax.grid(True, alpha=0.3)
    axes[0].axhline(0.9, color="grey", linestyle=":", linewidth=1)
    axes[0].legend(fontsize=8)
    thin = [
        load for load in loads if any(too_few(r["ttft_s"], "p99") for r in ladder[load].values())
    ]
    if thin:
        axes[1].set_title(f"p99 TTFT (s); n/a (n<100) at load {', '.join(thin)}", fontsize=9)
    fig.suptitle(f"open loop, estimated capacity {capacity:.1f} req/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_overload(body: dict[str, Any], path: Path) -> None:
    """The overload scenario against offered load, one line per setup: goodput, admitted
    p99 TTFT per lane, and how long a refused request waited for its answer."""
    plt = _pyplot()
    loads = sorted(body["loads"], key=float)
    xs = [float(load) for load in loads]
    setups = list(body["loads"][loads[0]]["setups"])

    def series(setup: str, *keys: str) -> list[float]:
        """One figure of a setup at every load, by its path of keys (nan where None)."""
        out = []
        for load in loads:
            value = body["loads"][load]["setups"][setup]
            for key in keys:
                value = value[key]
            out.append(math.nan if value is None else float(value))
        return out

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    goodput, ttft, wait = axes
    for i, setup in enumerate(setups):
        color = f"C{i}"
        goodput.plot(xs, series(setup, "goodput_rps"), "o-", color=color, label=setup)
        base = body["loads"][loads[0]]["setups"][setup]["goodput_rps"]
        goodput.axhline(0.9 * base, color=color, linestyle=":", linewidth=1)
        for lane, style in (("short", "o-"), ("long", "s--")):
            ys = series(setup, "admitted_ttft_s", lane, "p99")
            ttft.plot(xs, ys, style, color=color, label=f"{setup}, {lane}")
        for p, style in (("p50", "o-"), ("p90", "^--")):
            ys = series(setup, "refusal_wait_s", p)
            wait.plot(xs, ys, style, color=color, label=f"{setup}, {p}")
    goodput.set_ylim(bottom=0)
    ttft.axhline(body["slo"]["ttft"], color="grey", linestyle=":", linewidth=1)
    wait.axhline(0.1, color="grey", linestyle=":", linewidth=1)
    titles = (
        (goodput, "goodput, req/s within both SLOs (dotted: 90% of 1x)"),
        (ttft, "admitted requests' p99 TTFT, s (dotted: objective)"),
        (wait, "refused requests: time to the status line, s"),
    )
    from matplotlib.ticker import FuncFormatter, NullFormatter, NullLocator

    plain = FuncFormatter(lambda value, _: f"{value:g}")
    for ax, title in titles:
        ax.set_xscale("log")
        ax.set_xticks(xs, [f"{x:g}x" for x in xs])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("offered load, multiple of capacity")
        ax.set_title(title, fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in (ttft, wait):  # seconds from milliseconds to minutes
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(NullFormatter())
    fig.suptitle(f"overload: estimated capacity {body['capacity_req_per_s']:.1f} req/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
