"""The workers comparison's untimed parts: process-tree CPU, core plan, options, ratios."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from loadtest import coreplan, harness, overhead_workers

# Burns 0.3 s of its own CPU (not of wall time), says so, then waits for its stdin to close.
BURN = (
    "import sys, time\n"
    "start = time.process_time()\n"
    "while time.process_time() - start < 0.3:\n"
    "    pass\n"
    "print('burnt', flush=True)\n"
    "sys.stdin.read()\n"
)

# Runs one burner to the end and reaps it, keeps a second one alive, prints the live one's
# pid, then waits for its stdin to close: its own CPU stays small, its tree's holds 0.6 s.
PARENT = f"""
import subprocess, sys
BURN = {BURN!r}
subprocess.run([sys.executable, "-c", BURN], input="", text=True, capture_output=True)
live = subprocess.Popen(
    [sys.executable, "-c", BURN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
)
live.stdout.readline()
print(live.pid, flush=True)
sys.stdin.read()
live.stdin.close()
live.wait()
"""


@pytest.fixture
def parent() -> Iterator[tuple[subprocess.Popen[str], int]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert proc.stdin is not None
    live = int(proc.stdout.readline())
    try:
        yield proc, live
    finally:
        proc.stdin.close()
        proc.wait(30)
        proc.stdout.close()


@pytest.mark.slow  # child processes that burn CPU
def test_tree_cpu_counts_live_and_reaped_children(
    parent: tuple[subprocess.Popen[str], int],
) -> None:
    """The tree's CPU holds a live child's and a reaped child's burn, which the root's own lacks."""
    proc, _live = parent
    own = harness.cpu_seconds(proc.pid)
    tree = harness.tree_cpu_seconds(proc.pid)
    assert own < 0.3  # the parent itself only started two children
    assert tree - own >= 0.55  # two children of 0.3 s each, less /proc's tick rounding


@pytest.mark.slow  # child processes
def test_process_tree_lists_the_root_and_its_children(
    parent: tuple[subprocess.Popen[str], int],
) -> None:
    """process_tree starts at the root and reaches its live child, and nothing outside."""
    proc, live = parent
    tree = harness.process_tree(proc.pid)
    assert tree[0] == proc.pid
    assert live in tree
    assert len(tree) == 2  # the reaped child is gone; this test's process is not below it


def test_plan_keeps_groups_apart_on_a_big_machine() -> None:
    """With 8 cores and 2 workers the gateway gets 2 of its own; no warning."""
    plan = coreplan.plan_cores(range(8), 2)
    assert (plan.gateway, plan.fleet, plan.load) == ((0, 1), (2, 3), (4, 5, 6, 7))
    assert not plan.shared
    assert plan.warning() is None


def test_plan_on_two_cores_warns_that_it_says_nothing_about_scaling() -> None:
    """On 2 cores the fleet and the load share the gateway's: the plan says so."""
    plan = coreplan.plan_cores((0, 1), 2)
    assert plan.gateway == (0, 1)
    assert set(plan.fleet) | set(plan.load) <= {0, 1}
    assert plan.shared
    warning = plan.warning()
    assert warning is not None
    assert "NOT A SCALING FIGURE" in warning
    assert "may use 2: 0,1" in warning


def test_plan_honours_given_cores_and_flags_too_few_for_the_workers() -> None:
    """Given cores are used as they are; one gateway core for two workers is shared."""
    plan = coreplan.plan_cores(range(4), 2, gateway=(0,), fleet=(1,), load=(2, 3))
    assert (plan.gateway, plan.fleet, plan.load) == ((0,), (1,), (2, 3))
    assert plan.shared


def test_plan_refuses_cores_this_process_cannot_use() -> None:
    """A core outside the affinity set is a clear error, not a silent unpinned run."""
    with pytest.raises(ValueError, match="--load-cores 5: not available"):
        coreplan.plan_cores((0, 1), 2, load=(1, 5))


def test_options_parse_workers_and_core_ranges() -> None:
    """--workers and the three core options reach WorkersOptions as tuples."""
    args = overhead_workers.parser().parse_args(
        ["--workers", "1,2", "--gateway-cores", "0,1", "--fleet-cores", "2-3", "--load-cores",
         "4-6,8"]
    )  # fmt: skip
    opts = overhead_workers.options_of(args)
    assert opts.workers == (1, 2)
    assert (opts.gateway_cores, opts.fleet_cores, opts.load_cores) == ((0, 1), (2, 3), (4, 5, 6, 8))


@pytest.mark.parametrize(
    "argv", [["--workers", "2"], ["--workers", "0,2"], ["--gateway-cores", "3-1"]]
)
def test_options_refuse_bad_values(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """One setup, zero workers or a backwards core range is a usage error."""
    with pytest.raises(SystemExit) as exited:
        overhead_workers.parser().parse_args(argv)
    assert exited.value.code == 2
    assert "expected" in capsys.readouterr().err


def test_pin_prefix_pins_to_a_core_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """Several cores become one `taskset -c 0,1`; a core past the machine's pins nothing."""
    monkeypatch.setattr(harness.shutil, "which", lambda name: "/usr/bin/taskset")
    monkeypatch.setattr(harness.os, "cpu_count", lambda: 4)
    assert harness.pin_prefix((0, 1)) == ["taskset", "-c", "0,1"]
    assert harness.pin_prefix(2) == ["taskset", "-c", "2"]
    assert harness.pin_prefix((3, 4)) == []


def _round(ok: int, duration: float, cpu: float, used: float) -> dict[str, float]:
    return {
        "ok": ok,
        "requests": ok,
        "duration_s": duration,
        "gateway_cpu_s": cpu,
        "gateway_cores_used": used,
    }


def test_combine_pools_rounds_by_requests_and_time() -> None:
    """Rounds combine as total ok over total time and total CPU over total ok."""
    both = overhead_workers.combine([_round(100, 1.0, 0.1, 0.5), _round(300, 1.0, 0.3, 0.7)])
    assert both["requests_per_s"] == pytest.approx(200.0)
    assert both["cpu_ms_per_request"] == pytest.approx(1.0)
    assert both["gateway_cores_used"] == pytest.approx(0.6)


def test_ratios_are_against_the_fewest_workers() -> None:
    """2 workers at 1,800 req/s and 0.55 ms against 1 at 1,000 and 0.5: 1.8x and 1.1x."""
    setups = {
        1: {"requests_per_s": 1000.0, "cpu_ms_per_request": 0.5},
        2: {"requests_per_s": 1800.0, "cpu_ms_per_request": 0.55},
    }
    assert overhead_workers.ratios(setups) == {
        "2 / 1 workers": {
            "requests_per_s": pytest.approx(1.8),
            "cpu_per_request": pytest.approx(1.1),
        }
    }


def test_unsaturated_names_each_setup_below_its_cores() -> None:
    """A setup is flagged when its gateway used under 0.9 of a core per worker, else not."""
    setups = {
        "1": {"gateway_cores_used": 0.95},
        "2": {"gateway_cores_used": 1.2},
        "4": {"gateway_cores_used": 3.8},
    }
    lines = overhead_workers.unsaturated(setups)
    assert len(lines) == 1
    assert lines[0].startswith("workers=2: the gateway used 1.20 cores for 2 workers")
    assert "NOT SATURATED" in lines[0]
