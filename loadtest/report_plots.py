"""The plots of the sweep, compare (bars and ladder) and overload scenarios.

Each latency is drawn with the sample count it stands on, and a percentile there are too
few samples for (report.MIN_SAMPLES) is left out, not drawn as the maximum. The numbers
come from report.py's summaries; the pieces the other scenarios share are in plots.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from loadtest.report import MIN_SAMPLES, Summary, _pyplot, too_few


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
    """The overload scenario's figure (overload_figure), saved to `path`."""
    fig = overload_figure(body)
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)


def overload_figure(body: dict[str, Any]) -> Any:
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
    return fig
