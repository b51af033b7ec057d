"""One request's CPU, stage by stage: py-spy's samples of the gateway, sorted into the
stages a request goes through, times the measured CPU per request.

Each sample is given to the stage of its innermost frame that names one (a metric
incremented from the access-line code is metrics, not the access line). Samples in none
of the stages are the server's own HTTP work (aiohttp reading the client's request and
writing the answer) when an aiohttp frame is on the stack, else the event loop and
everything else. Shares are of all the samples taken while the gateway ran Python: the
loop's idle waits (py-spy cannot see into uvloop's C code) are left out, as
`overhead.top_frames` leaves them out.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

# (stage, fragments of a frame's "function (path)" that put it there), innermost first wins.
STAGES: Sequence[tuple[str, tuple[str, ...]]] = (
    ("metrics", ("prometheus_client/", "gateway/observe/metrics.py")),
    ("access line", ("structlog/", "gateway/observe/log.py", "gateway/observe/recorder.py")),
    ("tracing ids", ("gateway/observe/request_id.py", "gateway/observe/trace_context.py")),
    ("key check", ("gateway/proxy/auth.py",)),
    ("estimate", ("gateway/proxy/tokens.py", "gateway/proxy/tokenizer.py", "affinity.py")),
    ("body read and parse", ("gateway/proxy/intake.py", "gateway/proxy/body.py", "jsoncodec")),
    ("dispatch", ("gateway/dispatch/", "gateway/fleet/dispatcher.py")),
    (
        "connection and request write",
        ("gateway/upstream/pool.py", "gateway/upstream/client.py", "send_headers"),
    ),
    ("head parse and answer read", ("gateway/upstream/connection.py", "httptools")),
    ("relay", ("gateway/relay/",)),
    ("handler", ("gateway/proxy/", "gateway/server/")),
    ("aiohttp server", ("aiohttp/",)),
)
OTHER = "event loop and other"
# A sample whose innermost Python frame is the event loop's run() is the loop itself:
# waiting in epoll, or uvloop's C code doing I/O, which py-spy cannot see into.
LOOP_LEAVES = ("Runner.run (asyncio/runners.py)", "run (uvloop/__init__.py)")


def frame_name(frame: str) -> str:
    """ "handle (gateway/proxy/handler.py:171)" -> "handle (gateway/proxy/handler.py)":
    lines split a function; site-packages paths are cut to the package."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rpartition(":")[0] or where.rstrip(")")
    for marker in ("site-packages/", "lib/python3"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{name} ({path})"


def stage_of(frames: Sequence[str]) -> str:
    """The stage of one sample's stack (outermost frame first, as py-spy writes it)."""
    for frame in reversed(frames):
        for stage, fragments in STAGES:
            if any(fragment in frame for fragment in fragments):
                return stage
    return OTHER


def budget(collapsed: str, cpu_ms_per_request: float) -> dict[str, dict[str, float]]:
    """Per stage: its share of the samples and its microseconds of one request's CPU."""
    counts: Counter[str] = Counter()
    for line in collapsed.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = [frame_name(f) for f in stack.split(";")]
        if frames[-1] in LOOP_LEAVES:
            continue  # idle in the loop, or uvloop's C I/O: not a stage's
        counts[stage_of(frames)] += int(n)
    total = sum(counts.values()) or 1
    order = [stage for stage, _ in STAGES] + [OTHER]
    return {
        stage: {
            "share": round(counts[stage] / total, 4),
            "us_per_request": round(1000 * cpu_ms_per_request * counts[stage] / total, 1),
        }
        for stage in order
        if counts[stage]
    }


def table(stages: dict[str, dict[str, float]]) -> str:
    lines = ["| stage | share | µs per request |", "|---|---:|---:|"]
    for stage, row in stages.items():
        lines.append(f"| {stage} | {row['share']:.1%} | {row['us_per_request']:.0f} |")
    return "\n".join(lines)
