"""Plot pieces every scenario shares: sample counts, percentiles too thin to have, and
throughput over time; and the plots of `run` and `overhead`.

Every plot of latencies says how many samples each point stands on (n=...), leaves out a
percentile there are too few samples for (report.MIN_SAMPLES: "n/a (n<100)" for a p99),
and has a throughput panel beside it, so a latency is read with the load that made it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest import report
from loadtest.report import Summary


def n_of(stats: dict[str, Any]) -> int:
    return int(stats.get("n") or 0)


def pct_label(stats: dict[str, Any], key: str, scale: float = 1000.0, unit: str = "ms") -> str:
    """ "p99 412 ms", or "p99 n/a (n<100)" when there are too few samples for one."""
    value = stats.get(key)
    if value is None:
        if report.too_few(stats, key):
            return f"{key} n/a (n<{report.MIN_SAMPLES[int(key[1:])]})"
        return f"{key} -"
    return f"{key} {value * scale:.3g} {unit}"


def value_or_nan(stats: dict[str, Any], key: str, scale: float = 1.0) -> float:
    value = stats.get(key)
    return math.nan if value is None else value * scale


def throughput_panel(ax: Any, summaries: Sequence[Summary], what: str = "output_tokens") -> None:
    """Output tokens/s (or ok requests/s: what="ok") over time, one line per run."""
    for s in summaries:
        line = s.get("timeline")
        if not line:
            continue
        size = line["bin_s"]
        xs = [(i + 0.5) * size for i in range(len(line[what]))]
        ys = [v / size for v in line[what]]
        ax.plot(xs, ys, "-", drawstyle="steps-mid", label=f"{s['label']} (n={s['ok']})")
    ax.set_xlabel("time since the run's start (s)")
    ax.set_ylabel("output tokens/s" if what == "output_tokens" else "requests/s")
    ax.set_title("throughput over time", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


def requests_panel(ax: Any, xs: Sequence[float], line: dict[str, list[int]], size: float) -> None:
    """Answered and failed requests a second over a run, from per-bin counts."""
    ax.plot(xs, [v / size for v in line["ok"]], "-", drawstyle="steps-mid", label="ok req/s")
    ax.plot(
        xs,
        [v / size for v in line["failed"]],
        "-",
        drawstyle="steps-mid",
        color="C3",
        label="failed req/s",
    )


def plot_run(summary: Summary, path: Path, title: str) -> None:
    """One run: TTFT median over time with the run's percentiles; requests/s and tokens/s."""
    plt = report._pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    line, ttft = summary["timeline"], summary["ttft_s"]
    size = line["bin_s"]
    xs = [(i + 0.5) * size for i in range(len(line["ok"]))]
    ax = axes[0]
    ax.plot(
        xs,
        [math.nan if v is None else v * 1000 for v in line["ttft_p50_s"]],
        "o-",
        ms=3,
        label=f"TTFT median per {size:g} s",
    )
    for key, style in (("p50", "--"), ("p90", "-."), ("p99", ":")):
        label = pct_label(ttft, key)
        if ttft.get(key) is not None:
            ax.axhline(ttft[key] * 1000, color="grey", linestyle=style, linewidth=1, label=label)
        else:
            ax.plot([], [], " ", label=label)  # in the legend, to say why there is no line
    ax.set_xlabel("time since the run's start (s)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title(f"TTFT, n={n_of(ttft)} ok streams of {summary['requests']}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    ax = axes[1]
    requests_panel(ax, xs, line, size)
    ax.set_xlabel("time since the run's start (s)")
    ax.set_ylabel("requests/s")
    ax.grid(True, alpha=0.3)
    tokens = ax.twinx()
    tokens.plot(
        xs,
        [v / size for v in line["output_tokens"]],
        "-",
        drawstyle="steps-mid",
        color="C2",
        label="output tokens/s",
    )
    tokens.set_ylabel("output tokens/s")
    handles = ax.get_legend_handles_labels()
    more = tokens.get_legend_handles_labels()
    ax.legend(handles[0] + more[0], handles[1] + more[1], fontsize=7)
    ax.set_title("throughput over time (by when answers finished)", fontsize=9)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_overhead(body: dict[str, Any], path: Path) -> None:
    """Idle latency straight to the instance and through the gateway (p50/p90/p99, n=),
    and the loaded runs' requests/s over time."""
    plt = report._pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    runs = body["idle"]["runs"]
    keys = ("p50", "p90", "p99")
    width = 0.38
    for i, (arm, s) in enumerate(runs.items()):
        stats = s["latency_s"]
        xs = [k + i * width for k in range(len(keys))]
        ax.bar(
            xs,
            [value_or_nan(stats, k, 1000) for k in keys],
            width,
            label=f"{arm} (n={n_of(stats)})",
        )
        for x, k in zip(xs, keys, strict=True):
            if stats.get(k) is None:
                ax.annotate(
                    f"n/a\n(n<{report.MIN_SAMPLES[int(k[1:])]})",
                    (x, 0),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
    ax.set_xticks([k + width / 2 for k in range(len(keys))], keys)
    ax.set_ylabel("end-to-end latency (ms)")
    ax.set_title("idle, concurrency 1: straight to the instance vs via the gateway", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    loaded = [body[k]["run"] for k in ("cpu_instant", "cpu_paced") if k in body]
    loaded += [body["streams"]["run"]] if "streams" in body else []
    throughput_panel(axes[1], loaded, what="ok")
    fig.suptitle("what the gateway costs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def soak_timeline(
    finished: Sequence[tuple[float, bool, float]], started: float, span: float, most: int = 60
) -> dict[str, Any]:
    """The soak's answers per time bin (by when they finished): ok, failed, and the median
    latency of the ok ones (None in a bin without any)."""
    size = next((b for b in report._BINS if span / b <= most), report._BINS[-1])
    count = max(1, math.ceil(max(span, 1e-9) / size))
    ok, failed = [0] * count, [0] * count
    latencies: list[list[float]] = [[] for _ in range(count)]
    for at, good, latency in finished:
        i = min(count - 1, max(0, int((at - started) / size)))
        if good:
            ok[i] += 1
            latencies[i].append(latency)
        else:
            failed[i] += 1
    return {
        "bin_s": size,
        "ok": ok,
        "failed": failed,
        "latency_p50_s": [report.percentiles(v)["p50"] for v in latencies],
    }


def plot_soak(body: dict[str, Any], path: str | Path) -> None:
    """The soak over time: median latency per bin with the run's p50/p99 (n=, n/a below
    100), and ok and failed requests/s; each kill a vertical line on both."""
    plt = report._pyplot()
    line, stats = body["timeline"], body["latency_s"]
    size = line["bin_s"]
    xs = [(i + 0.5) * size for i in range(len(line["ok"]))]
    kills = [float(entry.split("s", 1)[0]) for entry in body["chaos"] if "killed" in entry]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    ax = axes[0]
    ax.plot(
        xs,
        [math.nan if v is None else v for v in line["latency_p50_s"]],
        "o-",
        ms=3,
        label=f"median per {size:g} s",
    )
    for key, style in (("p50", "--"), ("p99", ":")):
        label = pct_label(stats, key, scale=1.0, unit="s")
        if stats.get(key) is not None:
            ax.axhline(stats[key], color="grey", linestyle=style, linewidth=1, label=label)
        else:
            ax.plot([], [], " ", label=label)
    ax.set_ylabel("latency of answered requests (s)")
    ax.set_title(f"latency, n={n_of(stats)} answered of {body['sent']} sent", fontsize=9)
    ax = axes[1]
    requests_panel(ax, xs, line, size)
    ax.set_ylabel("requests/s")
    ax.set_title("throughput over time", fontsize=9)
    for ax in axes:
        for at in kills:
            ax.axvline(at, color="C3", alpha=0.3, linewidth=1)
        ax.set_xlabel("time since the start (s); red lines: an instance killed")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(
        f"soak: {body['concurrency']} clients, {body['instances']} instances, {body['kills']} kills"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
