"""How many prefill and decode instances a fleet of N should have: DistServe's placement
in its simplest form.

DistServe (arXiv 2401.09670, section 4) searches the parallelism and the number of
instances of each phase for the highest goodput per GPU. With one card type and no
parallelism to choose, what is left is the split: a disaggregated fleet serves at most
what its slower side serves, `min(prefill instances x prefill rate, decode instances x
decode rate)`, each rate the highest one instance of that role serves within the
objectives (measured, as the calibration does). The best split of N instances is the one
whose lower side is highest; the colocated fleet (every instance `both`) is the other
candidate, at N x the colocated rate.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Split:
    prefill: int  # instances with role "prefill"
    decode: int  # instances with role "decode" (0 and prefill 0: all colocated)
    rate: float  # requests/s the fleet serves within the objectives, as predicted

    @property
    def colocated(self) -> bool:
        return self.prefill == 0 and self.decode == 0


def best_split(
    instances: int, prefill_rate: float, decode_rate: float, colocated_rate: float
) -> Split:
    """The arrangement of `instances` predicted to serve the most within the objectives.

    `prefill_rate`, `decode_rate`, `colocated_rate`: what one instance serves within the
    objectives as a prefill-only, a decode-only and a colocated instance (requests/s).
    """
    if instances < 1:
        raise ValueError("a fleet needs at least one instance")
    best = Split(0, 0, instances * colocated_rate)
    for prefill in range(1, instances):
        decode = instances - prefill
        rate = min(prefill * prefill_rate, decode * decode_rate)
        if rate > best.rate:
            best = Split(prefill, decode, rate)
    return best


def main() -> None:
    """The split for 2 to 8 instances from the calibration's measured rates."""
    import json
    from pathlib import Path

    measured = json.loads(
        (Path(__file__).parents[1] / "results" / "disagg" / "calibration.json").read_text()
    )["setups"]
    rates = {name: measured[name]["measured_rps"] for name in ("prefill", "decode", "colocated")}
    print(f"per instance: {rates}")
    for n in range(2, 9):
        split = best_split(n, rates["prefill"], rates["decode"], rates["colocated"])
        shape = "colocated" if split.colocated else f"{split.prefill}P:{split.decode}D"
        print(f"{n} instances: {shape}, {split.rate:.2f} rps ({split.rate / n:.2f} per instance)")


if __name__ == "__main__":
    main()
