"""The fleet's capacity measured, not estimated: what the simulated cards serve kept full.

`compare.capacity` prices every request as its prefill plus its share of decode steps in
a full batch of `max_num_seqs`, with nothing lost between steps. Whether the engines
reach that is a measurement: a sequence in prefill is in the batch but not decoding, and
a late step on a loaded core is time the card does not get back.

Each card gets its own closed loop straight to it, `max_num_seqs` + `QUEUED` clients (no
front in the way, so no routing choice is measured), drawing requests from the same
mix. Over a window from a warm-up until the last request went out (every card busy
throughout), each request that ended is weighed by what the estimate prices it at
(`compare.request_cost`), so the measurement does not move with how many long prompts
a card happened to draw: a card's share is that priced work over the window times its
speed, and the fleet's capacity is the estimate times the fleet's share. A perfect router
serves that much and no more.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from gateway.sim.sim_engine import SimConfig
from loadtest import compare, harness
from loadtest.loadgen import (
    Client,
    Mix,
    RequestSpec,
    Route,
    Run,
    make_workload,
    run_closed,
)
from loadtest.loadgen import session as client_session
from loadtest.scenarios import Common, cores, fleet_names, say, to_v1

QUEUED = 4  # clients per card beyond its running slots: a waiting queue it never empties
WARM = 5.0  # s before the window opens: batches fill, the first long prefills pass
WINDOW = 30.0  # s the window lasts when the cards serve what the estimate says
ROUNDS = 4  # at the least, requests per client
SEED_OFFSET = 7919  # its requests are drawn apart from the benchmark's own


@dataclass(frozen=True)
class Measured:
    """A measured capacity and what it came from."""

    estimate_req_per_s: float  # compare.capacity's, for the same fleet and mix
    share_of_estimate: float  # priced work served / (window x the fleet's speed)
    window_s: float
    per_card: dict[str, float]  # fleet_names label -> that card's share

    @property
    def req_per_s(self) -> float:
        return self.estimate_req_per_s * self.share_of_estimate

    def as_json(self) -> dict[str, Any]:
        return {"req_per_s": self.req_per_s, **asdict(self)}


def work_in_window(
    run: Run, specs: Sequence[RequestSpec], names: dict[str, str], warm: float, sim: SimConfig
) -> tuple[float, dict[str, float]]:
    """(window, per card the priced seconds of work it served in it): the requests that
    ended from `warm` after the start until the last request went out, each at
    `compare.request_cost`; cards named by `names` (host:port -> label)."""
    start, stop = run.started + warm, run.last_sent
    window = stop - start
    if window <= 0:
        raise ValueError(f"no window: the last request went out {stop - run.started:.1f} s in")
    work = dict.fromkeys(names.values(), 0.0)
    for r in run.results:
        if r.ok and r.latency is not None and start <= r.sent + r.latency <= stop:
            spec = specs[r.index]
            label = names.get(r.instance, r.instance)
            cost = compare.request_cost(spec.tokens, r.tokens, sim)
            work[label] = work.get(label, 0.0) + cost
    return window, work


def shares(
    window: float, work: dict[str, float], speeds: dict[str, float]
) -> tuple[float, dict[str, float]]:
    """The fleet's share of its priced capacity that it served, and each card's."""
    per_card = {label: work[label] / (window * speeds[label]) for label in work}
    return sum(work.values()) / (window * sum(speeds.values())), per_card


async def measure(
    speeds: Sequence[float],
    mix: Mix,
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    common: Common,
    decode_s_per_token: float = SimConfig.decode_s_per_token,
    window: float | None = None,
) -> Measured:
    """Keep every card of a fresh fleet full for about WARM + `window` seconds (longer where
    the cards serve less than the estimate) and measure what share of the estimate it
    serves. `window`: None is WINDOW, read at the call (a test shortens it)."""
    window = WINDOW if window is None else window
    sim = SimConfig(max_num_seqs=max_num_seqs, decode_s_per_token=decode_s_per_token)
    estimate = compare.capacity(speeds, mix, sim)
    clients = (max_num_seqs + QUEUED) * len(speeds)
    # Every client sends several, so the last goes out well after the first ones end.
    count = max(math.ceil(estimate * (WARM + window)), ROUNDS * clients)
    specs = make_workload(count, mix, common.seed + SEED_OFFSET)
    _, fleet_core = cores(common)
    async with (
        harness.fleet_process(
            speeds,
            max_num_seqs=max_num_seqs,
            seed=common.seed,
            core=fleet_core,
            max_num_batched_tokens=max_num_batched_tokens,
            decode_s_per_token=decode_s_per_token,
        ) as fleet,
        client_session() as http,
    ):
        urls = [to_v1(url) for url in fleet.urls]
        route: Route = lambda spec, worker: urls[worker % len(urls)]  # noqa: E731
        run = await run_closed(
            Client(http, harness.KEY),
            specs,
            route,
            concurrency=clients,
            label="capacity",
            limit=common.limit,
        )
        names = fleet_names(fleet.urls, speeds)
    failed = run.unfinished + sum(not r.ok for r in run.results)
    if failed:
        raise RuntimeError(f"capacity run: {failed} of {count} requests not served")
    span, work = work_in_window(run, specs, names, WARM, sim)
    label_speeds = dict(zip(names.values(), speeds, strict=True))
    share, per_card = shares(span, work, label_speeds)
    measured = Measured(estimate, share, span, per_card)
    say(
        f"capacity measured {measured.req_per_s:.2f} req/s ({share:.1%} of the estimate"
        f" {estimate:.2f}), {span:.0f} s with every card kept full"
    )
    return measured
