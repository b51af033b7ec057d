"""Issue 10's targets, judged inside one `lanes` run: each gateway setup against the best
baseline that ran beside it on the same requests.

    python -m loadtest.lanes.targets results/lanes/lanes-6e72517-run2.json [more.json ...]
    python -m loadtest.lanes.targets FILE --setup least_time:cap1+queue_all

The targets (issue 10, "Targets"), per load:
- short p50 TTFT and short p50 end-to-end no higher than the best baseline's;
- the p99 TTFT of each prompt class at most `TAIL` times the best baseline's;
- output tokens/s at least the best baseline's, and goodput above every baseline's.

The p50 end-to-end of all requests is judged too: the issue's table has that column, and
the benchmark page reports it beside the short prompts' own. "Best" is the lowest
(highest for tokens/s and goodput) of the baselines in that run, per target: the
baselines move from run to run as much as we do, so only a run's own baselines count.

A setup named again with `#N` (`nginx#2`) is the same front run once more in the same
sitting, on the same requests. A repeat is not judged and does not count toward "best"
(two draws of nginx would raise the bar); it gives each target's A/A spread, how far
one front lands from itself, the noise floor a verdict near its bound is read against.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.baselines import BASELINES
from loadtest.helpfmt import HelpFormatter
from loadtest.report import Summary, table

TAIL = 0.5  # the p99 TTFT target: at most half the best baseline's


@dataclass(frozen=True)
class Target:
    name: str
    value: Callable[[Summary], float | None]
    higher_is_better: bool = False
    share_of_best: float = 1.0  # the bound, as a share of the best baseline's value
    strictly: bool = False  # must beat the best, not only reach it ("the highest")


def _pick(key: str, sub: str | None = None) -> Callable[[Summary], float | None]:
    def value(summary: Summary) -> float | None:
        got = summary.get(key)
        got = got.get(sub) if sub is not None and isinstance(got, Mapping) else got
        return None if got is None else float(got)

    return value


TARGETS = (
    Target("short p50 TTFT", _pick("short_ttft_s", "p50")),
    Target("short p50 end-to-end", _pick("short_latency_s", "p50")),
    Target("p50 end-to-end, all requests", _pick("latency_s", "p50")),
    Target("short p99 TTFT", _pick("short_ttft_s", "p99"), share_of_best=TAIL),
    Target("long p99 TTFT", _pick("long_ttft_s", "p99"), share_of_best=TAIL),
    Target("output tokens/s", _pick("output_tokens_per_s"), higher_is_better=True),
    Target("goodput (both objectives)", _pick("met_slo"), higher_is_better=True, strictly=True),
)


@dataclass(frozen=True)
class Verdict:
    target: str
    ours: float
    best: float  # the best baseline's value
    bound: float  # what ours had to reach: best x share_of_best
    met: bool


def judge(ours: Summary, baselines: Sequence[Summary]) -> list[Verdict]:
    """Every target that ours and at least one baseline report a value for."""
    out = []
    for target in TARGETS:
        mine = target.value(ours)
        theirs = [v for b in baselines if (v := target.value(b)) is not None]
        if mine is None or not theirs:
            continue
        best = max(theirs) if target.higher_is_better else min(theirs)
        bound = best * target.share_of_best
        if target.higher_is_better:
            met = mine > bound if target.strictly else mine >= bound
        else:
            met = mine < bound if target.strictly else mine <= bound
        out.append(Verdict(target.name, mine, best, bound, met))
    return out


def front(setup: str) -> str:
    """A setup without its repeat mark: `nginx#2` is nginx run a second time."""
    return setup.partition("#")[0]


def is_repeat(setup: str) -> bool:
    return front(setup) != setup


def baselines_of(runs: Mapping[str, Summary]) -> list[Summary]:
    """The baselines of one load, by their plain names (a repeat `nginx#2` is none)."""
    return [runs[name] for name in BASELINES if name in runs]


def judge_run(runs: Mapping[str, Summary]) -> dict[str, list[Verdict]]:
    """Each gateway setup of one load against the baselines beside it (none: nothing);
    repeats (`#N`) are neither judged nor baselines (see `spread`)."""
    baselines = baselines_of(runs)
    if not baselines:
        return {}
    return {
        name: judge(s, baselines)
        for name, s in runs.items()
        if name not in BASELINES and not is_repeat(name)
    }


@dataclass(frozen=True)
class Spread:
    target: str
    first: float
    again: float

    @property
    def relative(self) -> float:
        """|again - first| over the smaller of the two."""
        low = min(abs(self.first), abs(self.again))
        return abs(self.again - self.first) / low if low else 0.0


def spread(runs: Mapping[str, Summary]) -> dict[str, list[Spread]]:
    """Per repeat (`nginx#2`) whose first run is beside it: every target's value in both."""
    out = {}
    for name, again in runs.items():
        first = runs.get(front(name)) if is_repeat(name) else None
        if first is None:
            continue
        pairs = ((t, t.value(first), t.value(again)) for t in TARGETS)
        out[name] = [Spread(t.name, a, b) for t, a, b in pairs if a is not None and b is not None]
    return out


def render_spread(load: str, name: str, spreads: Sequence[Spread]) -> str:
    """A repeat's A/A spread at one load, as a text table."""
    rows = [
        [s.target, _number(s.target, s.first), _number(s.target, s.again), f"{s.relative:.1%}"]
        for s in spreads
    ]
    head = f"{name} at {float(load):.0%} of capacity: A/A spread against {front(name)}"
    return head + "\n" + table(["target", front(name), name, "spread"], rows)


def _number(target: str, value: float) -> str:
    if "TTFT" in target or "end-to-end" in target:
        return f"{value * 1000:,.0f} ms"
    return f"{value:,.1f}" if "tokens" in target else f"{value:,.0f}"


def render(load: str, setup: str, verdicts: Sequence[Verdict], summary: Summary) -> str:
    """One setup's verdicts at one load, as a text table. The heading says how many
    requests were answered: the latency targets count only those, goodput all of them."""
    rows = [
        [
            v.target,
            _number(v.target, v.ours),
            _number(v.target, v.best),
            _number(v.target, v.bound),
            "met" if v.met else "MISSED",
        ]
        for v in verdicts
    ]
    met = sum(v.met for v in verdicts)
    head = (
        f"{setup} at {float(load):.0%} of capacity: {met} of {len(verdicts)} targets met; "
        f"{summary['ok']} of {summary['requests']} requests answered"
    )
    if unjudged := len(TARGETS) - len(verdicts):
        head += f" ({unjudged} targets not judged: no value, e.g. too few samples for a p99)"
    return head + "\n" + table(["target", "ours", "best baseline", "bound", ""], rows)


def read_reports(paths: Iterable[Path]) -> Iterator[tuple[Path, dict[str, Any]]]:
    """Each of `paths` that holds a saved `lanes` report, with the report; any other JSON
    is skipped with a line on stderr."""
    for path in paths:
        body = json.loads(path.read_text())
        if isinstance(body, dict) and isinstance(body.get("loads"), dict):
            yield path, body
        else:
            print(f"{path}: not a lanes report (no loads), skipped", file=sys.stderr)


def render_report(path: Path, body: dict[str, Any], setup: str | None = None) -> str:
    """The verdicts of every load (and every gateway setup, or only `setup`) in the saved
    report `body`, read from `path`. Raises LookupError for a `setup` it does not have."""
    ref = body.get("source", {}).get("commit") or "?"
    parts = [f"{path} (gateway at {ref}; a setup named with @ref ran that ref)"]
    names = {name for runs in body["loads"].values() for name in runs}
    if setup is not None and setup not in names:
        raise LookupError(f"{path}: no setup {setup!r} (there: {', '.join(sorted(names))})")
    for load, runs in body["loads"].items():
        judged = judge_run(runs)
        if not judged:
            parts.append(f"{float(load):.0%}: no baseline ran beside the gateway; nothing judged")
        for name, verdicts in judged.items():
            if setup is None or name == setup:
                parts.append(render(load, name, verdicts, runs[name]))
        parts += [render_spread(load, name, s) for name, s in spread(runs).items()]
    return "\n\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.lanes.targets",
        description=__doc__.split("\n\n")[0],
        formatter_class=HelpFormatter,
    )
    parser.add_argument("reports", nargs="+", type=Path, help="lanes JSON reports")
    parser.add_argument("--setup", help="judge only this setup (default: every gateway setup)")
    args = parser.parse_args(argv)
    for path, body in read_reports(args.reports):
        try:
            print(render_report(path, body, args.setup), end="\n\n")
        except LookupError as e:
            parser.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
