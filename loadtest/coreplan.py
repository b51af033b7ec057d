"""Which cores a benchmark's groups of processes get: the gateway, the fleet, the load.

A figure about the gateway's use of several cores means something only when its
processes have those cores to themselves; `CorePlan.shared` says when they do not.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CorePlan:
    gateway: tuple[int, ...]
    fleet: tuple[int, ...]
    load: tuple[int, ...]
    workers: int  # the most workers any setup runs
    available: tuple[int, ...]  # the cores this process may use

    @property
    def shared(self) -> bool:
        """The gateway has fewer cores of its own than workers, so scaling is not measured."""
        others = set(self.fleet) | set(self.load)
        return len(set(self.gateway) - others) < self.workers

    def warning(self) -> str | None:
        if not self.shared:
            return None
        return (
            f"NOT A SCALING FIGURE: {self.workers} workers on gateway cores"
            f" {cores_text(self.gateway)} share cores with the fleet"
            f" ({cores_text(self.fleet)}) and the load generator ({cores_text(self.load)}),"
            " or have fewer cores than workers (this process may use"
            f" {len(self.available)}: {cores_text(self.available)}): the ratio it gives says"
            " nothing about how the gateway scales across cores."
        )


def cores_text(cores: Sequence[int]) -> str:
    return ",".join(map(str, cores))


def plan_cores(
    available: Sequence[int],
    workers: int,
    gateway: Sequence[int] | None = None,
    fleet: Sequence[int] | None = None,
    load: Sequence[int] | None = None,
) -> CorePlan:
    """Which cores the gateway, the fleet and the load generator get; the defaults keep them
    apart where there are enough cores, else the fleet and the load share the gateway's."""
    have = sorted(available)
    for name, chosen in (("gateway", gateway), ("fleet", fleet), ("load", load)):
        missing = sorted(set(chosen or ()) - set(have))
        if missing:
            raise ValueError(
                f"--{name}-cores {cores_text(missing)}: not available (have {cores_text(have)})"
            )
    gw = tuple(gateway or have[:workers])
    rest = [c for c in have if c not in gw] or have
    fl = tuple(fleet or rest[: max(1, len(rest) // 3)])
    ld = tuple(load or ([c for c in rest if c not in fl] or fl))
    return CorePlan(gw, fl, ld, workers, tuple(have))


def core_list(text: str) -> tuple[int, ...]:
    """The cores of "0,1", "2-5" or "0,4-7" (an argparse type)."""
    cores: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or not (hi or lo).isdigit() or int(hi or lo) < int(lo):
            raise argparse.ArgumentTypeError(f"expected cores like 0,1 or 2-5, got {text!r}")
        cores += range(int(lo), int(hi or lo) + 1)
    if not cores:
        raise argparse.ArgumentTypeError(f"expected cores like 0,1 or 2-5, got {text!r}")
    return tuple(dict.fromkeys(cores))
