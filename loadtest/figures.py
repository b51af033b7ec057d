"""The benchmark page's plots, drawn again from the result files its tables quote.

    python -m loadtest.figures                  # docs/figures/*.svg from loadtest/results/
    python -m loadtest.figures --out /tmp/f     # somewhere else

One small SVG per headline section of docs/benchmarks.md (FIGURES: its name, the result
files that section's table quotes, and how it is drawn), titled with the commit the
figures were measured at. Nothing but those named files is read, so a result left in
loadtest/results/ by a local run changes no figure. The rules of plots.py hold: each
latency says how many samples it stands on, and a percentile there are too few samples
for is left out, not drawn.

The files are the same to the byte for the same results and matplotlib version (no date,
fixed element ids, text kept as text rather than glyph outlines), so a figure changes in
git only when its data does.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest import report, report_plots
from loadtest.plots import value_or_nan

Body = dict[str, Any]
ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "loadtest" / "results"
OUT = ROOT / "docs" / "figures"

# The style every figure is drawn in, applied only while drawing (rc_context). DejaVu
# Sans ships with matplotlib, so the layout is computed from the same metrics everywhere.
# (Any: matplotlib's stubs want each key as a literal of its own.)
STYLE: Any = {
    "svg.fonttype": "none",
    "svg.hashsalt": "loadtest.figures",
    "font.family": "DejaVu Sans",
    "font.size": 8,
    "axes.titlesize": 9,
    "legend.fontsize": 7,
    "axes.grid": True,
    "grid.alpha": 0.3,
}


@dataclass(frozen=True)
class Figure:
    """One plot of the page: the result files it reads (relative to the results folder)
    and the function that draws it from their bodies, in that order."""

    name: str
    sources: tuple[str, ...]
    draw: Callable[[Sequence[Body]], Any]


def commit_of(body: Body) -> str:
    return str(body["source"]["commit"])


def stats_of(run: Body, key: str) -> Body:
    """A run's percentiles of `key`, with its sample count: older reports leave `n` out of
    the percentiles, and there every ok request has each figure."""
    stats = dict(run[key])
    stats.setdefault("n", run["ok"])
    return stats


def ms(stats: Body, key: str) -> float:
    return value_or_nan(stats, key, 1000.0)


def n_text(counts: Sequence[int]) -> str:
    """ "n=423", or "n=412-423" where the points stand on different counts."""
    low, high = min(counts), max(counts)
    return f"n={low:,}" if low == high else f"n={low:,}-{high:,}"


def percentile_dots(ax: Any, rows: Sequence[Body], keys: Sequence[str]) -> None:
    """Each row's percentiles of TTFT (ms) as marks on a log axis, one marker a percentile;
    a percentile with too few samples is left out and said so beside its row."""
    ys = list(range(len(rows)))
    for key, marker in zip(keys, ("o", "s", "^"), strict=False):
        ax.plot([ms(r, key) for r in rows], ys, marker, ms=4, linestyle="none", label=key)
    for y, stats in zip(ys, rows, strict=True):
        thin = [k for k in keys if report.too_few(stats, k)]
        if thin:
            need = report.MIN_SAMPLES[int(thin[-1][1:])]
            ax.annotate(
                f"{'/'.join(thin)} n/a (n<{need})",
                (1, y),
                xycoords=("axes fraction", "data"),
                xytext=(-3, 0),
                textcoords="offset points",
                ha="right",
                va="center",
                fontsize=6,
            )
    plain_log(ax, "x")
    ax.set_xlabel("TTFT (ms, log)")
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=len(keys))


def plain_log(ax: Any, which: str) -> None:
    """A log scale on `which` axis ("x" or "y") labelled 30, 100, 1000, not 10^2."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    getattr(ax, f"set_{which}scale")("log")
    axis = ax.xaxis if which == "x" else ax.yaxis
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_formatter(NullFormatter())


def row_axes(plt: Any, labels: Sequence[str], panels: int, width: float = 9.0) -> Any:
    """A figure of `panels` side by side sharing one row per label, top row first; its
    layout is constrained (room for long row labels and legends above the axes)."""
    fig, axes = plt.subplots(
        1,
        panels,
        figsize=(width, 1.5 + 0.2 * len(labels)),
        sharey=True,
        squeeze=False,
        layout="constrained",
    )
    axes = axes[0]
    axes[0].set_yticks(range(len(labels)), labels)
    axes[0].invert_yaxis()
    for ax in axes:
        ax.grid(True, axis="y", alpha=0)
    return fig, axes


# -- overhead ---------------------------------------------------------------------------

FRONTS = ("gateway", "floor-aiohttp", "floor-httptools", "nginx", "vllm-router")
TARGETS = {("instant", "32"): 1.3, ("paced", "32"): 1.5, ("paced", "128"): 1.5}


def overhead(bodies: Sequence[Body]) -> Any:
    """CPU per streamed request of each front over vllm-router round robin's, per fleet
    and concurrency, with issue 44's targets."""
    (body,) = bodies
    cells = body["fronts"]["cells"]
    keys = [(kind, c) for kind in ("instant", "paced") for c in sorted(cells[kind], key=int)]
    plt = report._pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 3.2))
    width = 0.8 / len(FRONTS)
    for i, front in enumerate(FRONTS):
        xs = [k + (i - (len(FRONTS) - 1) / 2) * width for k in range(len(keys))]
        ys = [
            cells[kind][c][front]["cpu_ms_per_request"]
            / cells[kind][c]["vllm-router-rr"]["cpu_ms_per_request"]
            for kind, c in keys
        ]
        name = "vllm-router (cache_aware)" if front == "vllm-router" else front
        ax.bar(xs, ys, width, label=name, color=f"C{i}")
    for k, key in enumerate(keys):
        if key in TARGETS:
            ax.hlines(TARGETS[key], k - 0.45, k + 0.45, color="k", linestyle="--", linewidth=1)
    ax.plot([], [], "k--", linewidth=1, label="gateway's target")
    ax.axhline(1.0, color="grey", linewidth=1)
    labels = [
        f"{kind}, c={c}\nrr {cells[kind][c]['vllm-router-rr']['cpu_ms_per_request']:.2f} ms"
        for kind, c in keys
    ]
    ax.set_xticks(range(len(keys)), labels)
    ax.set_ylabel("CPU per request / vllm-router-rr's")
    ax.grid(True, axis="x", alpha=0)
    ax.legend(ncol=3, loc="upper left")
    ax.set_ylim(0, 3.2)
    requests = {cells[kind][c][f]["requests"] for kind, c in keys for f in FRONTS}
    ax.set_title(
        f"overhead at {commit_of(body)}: CPU per streamed request against the router's\n"
        f"round robin (vllm-router-rr, grey line), {n_text(sorted(requests))} requests a bar"
    )
    fig.tight_layout()
    return fig


# -- compare and least_time: the slow-card fleet -----------------------------------------


def compare(bodies: Sequence[Body]) -> Any:
    """The slow-card fleet at 75% load: TTFT percentiles and goodput of each setup."""
    (body,) = bodies
    runs = body["phases"]["open"]
    names = list(runs)
    ttft = [stats_of(runs[name], "ttft_s") for name in names]
    plt = report._pyplot()
    labels = [f"{name} (n={s['n']:,})" for name, s in zip(names, ttft, strict=True)]
    fig, (left, right) = row_axes(plt, labels, 2, width=8.0)
    percentile_dots(left, ttft, ("p50", "p90", "p99"))
    right.barh(range(len(names)), [runs[name]["goodput_rps"] for name in names], color="C2")
    right.set_xlabel("goodput (req/s within both SLOs)")
    speeds = ", ".join(f"{s:g}" for s in body["options"]["speeds"])
    fig.suptitle(
        f"compare at {commit_of(body)}: fleet {speeds}, open loop at "
        f"{body['open_rate_req_per_s']:.1f} req/s",
        fontsize=9,
    )
    return fig


def least_time(bodies: Sequence[Body]) -> Any:
    """least_time against least_busy on the slow-card fleet at 75-125% of capacity, and on
    an even fleet at 75%: p99 TTFT and goodput."""
    ladder, even = bodies
    loads = {"0.75": ladder["phases"]["open"]} | {
        load: ladder["ladder"][load] for load in sorted(ladder["ladder"], key=float)
    }
    xs = [float(load) * 100 for load in loads]
    plt = report._pyplot()
    fig, (ttft, goodput) = plt.subplots(1, 2, figsize=(7.5, 2.8))
    for i, name in enumerate(("least_busy", "least_time")):
        stats = [stats_of(runs[name], "ttft_s") for runs in loads.values()]
        counts = "/".join(f"{s['n']}" for s in stats)
        ttft.plot(
            xs, [ms(s, "p99") for s in stats], "o-", color=f"C{i}", label=f"{name} (n={counts})"
        )
        goodput.plot(
            xs,
            [runs[name]["goodput_rps"] for runs in loads.values()],
            "o-",
            color=f"C{i}",
            label=name,
        )
        flat = even["phases"]["open"][name]
        ttft.plot([75], [ms(stats_of(flat, "ttft_s"), "p99")], "D", mfc="none", color=f"C{i}")
        goodput.plot([75], [flat["goodput_rps"]], "D", mfc="none", color=f"C{i}")
    ttft.plot([], [], "kD", mfc="none", label="even fleet 1, 1, 1, 1")
    for ax in (ttft, goodput):
        ax.set_xticks(xs, [f"{x:g}%" for x in xs])
        ax.set_xlabel("offered load, share of capacity")
    ttft.set_ylabel("p99 TTFT (ms)")
    goodput.set_ylabel("goodput (req/s)")
    ttft.legend()
    speeds = ", ".join(f"{s:g}" for s in ladder["options"]["speeds"])
    fig.suptitle(f"least_time at {commit_of(ladder)}: fleet {speeds} (filled)", fontsize=9)
    fig.tight_layout()
    return fig


# -- lanes ------------------------------------------------------------------------------

LANES_METRICS = (
    ("short_ttft_s", "p50", "short prompts' p50 TTFT, ms", False),
    ("latency_s", "p50", "p50 end-to-end of all, ms", False),
    ("short_ttft_s", "p99", "short prompts' p99 TTFT, ms (log)", True),
)


def lanes(bodies: Sequence[Body]) -> Any:
    """Issue 10's mix at 75% with defaults, three seeds: the gateway before and after
    issue 45's second rule, beside nginx and both vllm-router policies."""
    plt = report._pyplot()
    fig, axes = plt.subplots(1, len(LANES_METRICS), figsize=(9.0, 3.0))
    setups = list(bodies[0]["loads"]["0.75"])
    width = 0.8 / len(setups)
    for ax, (key, p, title, log) in zip(axes, LANES_METRICS, strict=True):
        counts = []
        for i, setup in enumerate(setups):
            stats = [body["loads"]["0.75"][setup][key] for body in bodies]
            counts += [s["n"] for s in stats]
            xs = [seed + (i - (len(setups) - 1) / 2) * width for seed in range(1, len(bodies) + 1)]
            ax.plot(xs, [ms(s, p) for s in stats], "o", ms=4, color=f"C{i}", label=setup)
        ax.set_xticks(range(1, len(bodies) + 1), [f"seed {s}" for s in range(1, len(bodies) + 1)])
        ax.set_title(f"{title}\n{n_text(counts)} a point", fontsize=8)
        ax.grid(True, axis="x", alpha=0)
        if log:
            plain_log(ax, "y")
    axes[0].legend(fontsize=6)
    fig.suptitle(
        f"lanes at {commit_of(bodies[0])}: issue 10's mix, slow-card fleet, 75% load, defaults",
        fontsize=9,
    )
    fig.tight_layout()
    return fig


# -- prefix and kv ----------------------------------------------------------------------

# The runs the page's table takes the median of, per scenario: the first conversations
# sitting (prefix-run1) was set aside for a third.
PREFIX_RUNS = {
    "uniform": (0, 1),
    "zipf": (0, 1),
    "saturation": (0, 1),
    "conversations": (0, 2),
}


def prefix(bodies: Sequence[Body]) -> Any:
    """Prefix-cache affinity per scenario and setup, medians of two runs: hit rate, TTFT
    p50 and p99, and tokens/s."""
    rows: list[tuple[str, float, Body, float]] = []
    for scenario, picks in PREFIX_RUNS.items():
        for setup in bodies[picks[0]]["scenarios"][scenario]["runs"]:
            runs = [bodies[i]["scenarios"][scenario]["runs"][setup] for i in picks]
            ttft = [stats_of(r, "ttft_s") for r in runs]
            median = {
                "n": min(s["n"] for s in ttft),
                **{
                    k: statistics.median(s[k] for s in ttft)
                    if all(s[k] is not None for s in ttft)
                    else None
                    for k in ("p50", "p99")
                },
            }
            label = f"{scenario}: {setup} (n={'/'.join(str(s['n']) for s in ttft)})"
            hit = statistics.median(r["cache"]["hit_rate"] for r in runs)
            tokens = statistics.median(r["output_tokens_per_s"] for r in runs)
            rows.append((label, hit, median, tokens))
    plt = report._pyplot()
    fig, (hits, ttft_ax, tokens_ax) = row_axes(plt, [r[0] for r in rows], 3, width=10.0)
    hits.barh(range(len(rows)), [r[1] for r in rows], color="C0")
    hits.set_xlim(0, 1)
    hits.set_xlabel("prefix cache hit rate")
    percentile_dots(ttft_ax, [r[2] for r in rows], ("p50", "p99"))
    tokens_ax.barh(range(len(rows)), [r[3] for r in rows], color="C2")
    tokens_ax.set_xlabel("output tokens/s")
    fig.suptitle(f"prefix at {commit_of(bodies[0])}: medians of two runs", fontsize=9)
    return fig


def kv(bodies: Sequence[Body]) -> Any:
    """The exact prefix index against the inferred one and vllm-router cache_aware, per
    case: the hit rate the instances found beside the gateway's estimate, and TTFT."""
    (body,) = bodies
    labels, true, estimated, ttft = [], [], [], []
    for case, entry in body["cases"].items():
        for arm, run in entry.get("runs", {}).items():
            index = run["index"]  # what the front's own requests found, bypass or not
            labels.append(f"{case}: {arm} (n={run['ttft_s']['n']})")
            true.append(index["true"]["hit_rate"])
            estimated.append(index["estimated"]["hit_rate"] if index["estimated"] else math.nan)
            ttft.append(run["ttft_s"])
    plt = report._pyplot()
    fig, (hits, ttft_ax) = row_axes(plt, labels, 2, width=8.0)
    hits.barh(range(len(labels)), true, color="C0", label="true (the instances')")
    hits.plot(estimated, range(len(labels)), "kx", ms=5, label="the gateway's estimate")
    hits.set_xlim(0, 1)
    hits.set_xlabel("prefix cache hit rate")
    hits.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2)
    percentile_dots(ttft_ax, ttft, ("p50", "p90", "p99"))
    fig.suptitle(
        f"kv at {commit_of(body)}: exact index (KV events), approx, vllm-router", fontsize=9
    )
    return fig


# -- prefill/decode disaggregation -------------------------------------------------------

PD_FRONTS = (
    ("pd-2p1d-vllm-router", "vllm-router PD"),
    ("pd-2p1d-gateway-defaults", "gateway, defaults"),
    ("pd-2p1d-gateway", "gateway, [slo]"),
)


def pd(bodies: Sequence[Body]) -> Any:
    """Each calibration's capacity curves: the share of requests within both objectives
    against the rate per instance, every point the bisection ran, per front."""
    (body,) = bodies
    points = [body["points"][k] for k in sorted(body["points"], key=int)]
    plt = report._pyplot()
    fig, axes = plt.subplots(2, (len(points) + 1) // 2, figsize=(10.0, 4.6), sharey=True)
    counts: list[int] = []
    for ax, point in zip(axes.flat, points, strict=True):
        for i, (key, name) in enumerate(PD_FRONTS):
            arm = point[key]
            ran = sorted(arm["points"], key=lambda p: p["rate"])
            counts += [p["requests"] for p in ran]
            ax.plot(
                [p["rate"] / len(arm["roles"]) for p in ran],
                [p["attainment"] * 100 for p in ran],
                marker="o",
                ms=3,
                color=f"C{i}",
                linestyle=("-", "--", ":")[i],
                label=name,
            )
        ax.axhline(90, color="grey", linewidth=1)
        scale = point["scale"]
        ax.set_title(
            f"x{scale['prefill']:g}, x{scale['transfer']:g}, x{scale['decode']:g}: "
            f"{point['pd-2p1d-vllm-router']['per_instance_rps']:.2f} / "
            f"{point['pd-2p1d-gateway']['per_instance_rps']:.2f}",
            fontsize=8,
        )
    for ax in axes[-1]:
        ax.set_xlabel("rps per instance")
    for ax in axes[:, 0]:
        ax.set_ylabel("% within both")
    axes[0][0].legend(fontsize=6, loc="lower left")
    fig.suptitle(
        f"PD capacity curves at {commit_of(body)}, 2P:1D: prefill, transfer, decode scale; "
        f"router / gateway capacity (rps per instance); {n_text(counts)} requests a point",
        fontsize=9,
    )
    fig.tight_layout()
    return fig


# -- overload ---------------------------------------------------------------------------


def overload(bodies: Sequence[Body]) -> Any:
    """The overload scenario's own figure (report_plots), titled with its commit."""
    (body,) = bodies
    fig = report_plots.overload_figure(body)
    fig.set_size_inches(10.0, 3.4)
    fig.suptitle(
        f"overload at {commit_of(body)}: estimated capacity {body['capacity_req_per_s']:.1f} req/s",
        fontsize=9,
    )
    fig.tight_layout()
    return fig


FIGURES: Mapping[str, Figure] = {
    f.name: f
    for f in (
        Figure("overhead", ("overhead-floor/overhead.json",), overhead),
        Figure("compare", ("compare.json",), compare),
        Figure(
            "least-time",
            ("least-time/slow-card-ladder.json", "least-time/equal-fleet.json"),
            least_time,
        ),
        Figure("lanes", tuple(f"lanes/issue45b-seed{s}.json" for s in (1, 2, 3)), lanes),
        Figure(
            "prefix",
            ("prefix.json", "prefix-run1/prefix.json", "prefix-run3/prefix.json"),
            prefix,
        ),
        Figure("kv", ("kv/kv.json",), kv),
        Figure("pd-capacity", ("disagg/calibration-range.json",), pd),
        Figure("overload", ("overload-after-fix/overload.json",), overload),
    )
}


def render(results: Path = RESULTS, out: Path = OUT, names: Sequence[str] = ()) -> list[Path]:
    """Draw the named figures (all by default) from `results` into `out` as SVG files;
    returns their paths."""
    import matplotlib

    plt = report._pyplot()
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in names or FIGURES:
        figure = FIGURES[name]
        bodies = [json.loads((results / s).read_text(encoding="utf-8")) for s in figure.sources]
        with matplotlib.rc_context(STYLE):
            fig = figure.draw(bodies)
            path = out / f"{name}.svg"
            fig.savefig(path, format="svg", metadata={"Date": None})
            plt.close(fig)
        written.append(path)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.figures", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("names", nargs="*", help=f"of {', '.join(FIGURES)} (default: all)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the result files' root")
    parser.add_argument("--out", type=Path, default=OUT, help="where the SVG files go")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in FIGURES]
    if unknown:
        parser.error(f"no figure named {', '.join(unknown)}; there are {', '.join(FIGURES)}")
    if not report.can_plot():
        print("error: matplotlib is not installed (pip install -e '.[bench]')", file=sys.stderr)
        return 1
    for path in render(args.results, args.out, args.names):
        print(f"{path} {path.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
