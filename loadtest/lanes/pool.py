"""Issue 10's targets pooled over sittings: how one setup stands against the best
baseline beside it, sitting after sitting, rather than in one.

    python -m loadtest.lanes.pool results/lanes/*.json \
        --setup least_time:cap1+queue_all --commit COMMIT [--commit COMMIT ...]

Each sitting is judged as `targets` judges it, against its own baselines. Per load
and target this prints in how many sittings the target was met, and the margin: the
bound over ours for a figure where lower is better, ours over the bound where higher
is, so above 1 is met. The margins are summed up as their geometric mean with an
interval of two standard errors of the mean of their logarithms: where the interval
holds 1, the sittings cannot tell the setup from its bound, whatever a single sitting
said.

A setup is its name without any `@ref`, run at a commit: the ref, or else the commit the
report names. `--commit` keeps only sittings at those commits: pool commits whose
`gateway/` is the same (`git rev-parse REF:gateway`), or the figures mix two gateways.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.helpfmt import HelpFormatter
from loadtest.lanes.targets import TARGETS, Verdict, judge_run, read_reports
from loadtest.report import table


@dataclass(frozen=True)
class Pooled:
    load: str
    target: str
    margins: tuple[float, ...]  # one per sitting: above 1 is met
    met: int  # sittings where the target was met (goodput: strictly above the bound)

    @property
    def geometric_mean(self) -> float:
        return statistics.geometric_mean(self.margins)

    @property
    def interval(self) -> tuple[float, float] | None:
        """The geometric mean's two-standard-error interval (None under two sittings)."""
        if len(self.margins) < 2:
            return None
        logs = [math.log(m) for m in self.margins]
        mean, half = statistics.fmean(logs), 2 * statistics.stdev(logs) / math.sqrt(len(logs))
        return math.exp(mean - half), math.exp(mean + half)


def margin(verdict: Verdict, higher_is_better: bool) -> float:
    """Above 1 where `verdict` is on the good side of its bound, by that factor."""
    if higher_is_better:
        return verdict.ours / verdict.bound
    return verdict.bound / verdict.ours


def ran(name: str, report_commit: str) -> tuple[str, str]:
    """A setup's name as (the setup without `@ref`, the commit it ran).

    >>> ran("least_time:cap1@41a1591", "c677319")
    ('least_time:cap1', '41a1591')
    >>> ran("least_time:cap1", "c677319")
    ('least_time:cap1', 'c677319')
    """
    setup, _, ref = name.partition("@")
    return setup, ref or report_commit


def pool(
    reports: Sequence[dict[str, Any]], setup: str, commits: Collection[str] | None = None
) -> list[Pooled]:
    """Every target at every load where `setup` was judged in some report, at one of
    `commits` as the reports name them (None: at any). A verdict with a zero on either
    side (a baseline with no request in both objectives) has no margin and is left out."""
    better = {t.name: t.higher_is_better for t in TARGETS}
    found: dict[tuple[str, str], list[Verdict]] = {}
    for load, v in _verdicts(reports, setup, commits):
        if v.ours > 0 and v.bound > 0:
            found.setdefault((load, v.target), []).append(v)
    return [
        Pooled(
            load,
            target,
            tuple(margin(v, better[target]) for v in verdicts),
            sum(v.met for v in verdicts),
        )
        for (load, target), verdicts in sorted(found.items(), key=lambda kv: float(kv[0][0]))
    ]


def _verdicts(
    reports: Sequence[dict[str, Any]], setup: str, commits: Collection[str] | None
) -> Iterator[tuple[str, Verdict]]:
    """(load, verdict) of every sitting of `setup` at one of `commits` (None: any)."""
    for body in reports:
        commit = str(body.get("source", {}).get("commit") or "?")
        for load, runs in body["loads"].items():
            for name, verdicts in judge_run(runs).items():
                this, at = ran(name, commit)
                if this == setup and (commits is None or at in commits):
                    yield from ((f"{float(load):g}", v) for v in verdicts)


def render(pooled: Sequence[Pooled]) -> str:
    rows = []
    for p in pooled:
        interval = p.interval
        rows.append(
            [
                f"{float(p.load):.0%}",
                p.target,
                f"{p.met} of {len(p.margins)}",
                f"{p.geometric_mean:.3f}",
                "n/a" if interval is None else f"{interval[0]:.3f}-{interval[1]:.3f}",
                f"{min(p.margins):.3f}-{max(p.margins):.3f}",
            ]
        )
    head = ["load", "target", "met", "margin (geo. mean)", "2 SE", "range"]
    return table(head, rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.lanes.pool",
        description=__doc__.split("\n\n")[0],
        formatter_class=HelpFormatter,
    )
    parser.add_argument("reports", nargs="+", type=Path, help="lanes JSON reports")
    parser.add_argument("--setup", required=True, help="the setup to pool, without @ref")
    parser.add_argument(
        "--commit",
        action="append",
        help="only sittings at this commit, again for more (default: at any)",
    )
    args = parser.parse_args(argv)
    bodies = [body for _, body in read_reports(args.reports)]
    pooled = pool(bodies, args.setup, args.commit)
    if not pooled:
        parser.error(f"no report judged {args.setup} (at {args.commit or 'any commit'})")
    print(render(pooled))
    return 0


if __name__ == "__main__":
    sys.exit(main())
