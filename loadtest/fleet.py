"""`python -m loadtest.fleet`: the simulated fleet's command line, kept for the checkout's
scripts and READMEs; the fleet itself is `gateway.sim.sim_fleet` (also a `python -m` entry)."""

from __future__ import annotations

import sys

from gateway.sim.sim_fleet import main, start_fleet, stop_fleet

__all__ = ["main", "start_fleet", "stop_fleet"]

if __name__ == "__main__":
    sys.exit(main(prog="python -m loadtest.fleet"))
