"""The one owner of shutdown (lifecycle.py): its states, the drain, the abort, the signals."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest
from fakes import fleet, write_config

from gateway.config import load as gateway_config
from gateway.lifecycle import Lifecycle
from gateway.process.serve import serve
from gateway.sim.sim_vllm import SimConfig


def _previous(signum: int, frame: FrameType | None) -> None:
    raise AssertionError("the handler from before must not run while the lifecycle has it")


@pytest.fixture
def own_sigterm() -> Iterator[None]:
    """A Python-level SIGTERM handler of the embedding program, put back after the test."""
    before = signal.signal(signal.SIGTERM, _previous)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


async def test_states_move_from_serving_to_draining_to_forced() -> None:
    """The first stop starts the drain, the second forces it; the repr says which."""
    life = Lifecycle()
    assert repr(life) == "<Lifecycle serving requests=0>"
    life.stop()
    assert life.stopping.is_set()
    assert not life.forced.is_set()
    life.draining = True
    life.stop()
    assert life.forced.is_set()
    assert repr(life) == "<Lifecycle draining forced requests=0>"


async def test_drain_waits_for_requests_that_finish_in_time() -> None:
    """Requests that end within the drain time are not cancelled and nothing is aborted."""
    life = Lifecycle()

    async def request() -> str:
        task = asyncio.current_task()
        assert task is not None
        life.track(task)
        try:
            await asyncio.sleep(0.05)
            return "answered"
        finally:
            life.done(task)

    task = asyncio.create_task(request())
    await asyncio.sleep(0)
    assert life.in_progress == 1
    assert await life.drain(5.0) == 0
    assert await task == "answered"
    assert not life.aborting


async def test_the_rest_are_cancelled_at_the_deadline_and_see_aborting() -> None:
    """At the drain deadline the requests still running are cancelled, after `aborting` is
    set and the abort callbacks ran, so each can answer instead of acting as if its client left."""
    life = Lifecycle()
    told: list[str] = []
    life.on_abort(lambda: told.append("abort"))
    seen: list[bool] = []

    async def request() -> None:
        task = asyncio.current_task()
        assert task is not None
        life.track(task)
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            seen.append(life.aborting)
            raise
        finally:
            life.done(task)

    tasks = [asyncio.create_task(request()) for _ in range(3)]
    await asyncio.sleep(0)
    assert await life.drain(0.05) == 3
    assert seen == [True, True, True]
    assert told == ["abort"]
    assert all(t.cancelled() for t in tasks)
    assert life.in_progress == 0


async def test_a_second_stop_cuts_the_drain_short() -> None:
    """A forced stop during a long drain ends the wait at once and aborts what runs."""
    life = Lifecycle()
    life.stop()

    async def request() -> None:
        task = asyncio.current_task()
        assert task is not None
        life.track(task)
        try:
            await asyncio.sleep(60)
        finally:
            life.done(task)

    task = asyncio.create_task(request())
    await asyncio.sleep(0)
    asyncio.get_running_loop().call_later(0.05, life.stop)
    async with asyncio.timeout(5):
        assert await life.drain(60) == 1
    assert task.cancelled()


async def test_signals_call_stop_inside_and_the_old_handlers_are_back_after(
    own_sigterm: None,
) -> None:
    """Inside `signals()` SIGTERM calls `stop`; on leaving, the handler from before is back."""
    life = Lifecycle()
    with life.signals():
        os.kill(os.getpid(), signal.SIGTERM)
        async with asyncio.timeout(5):
            await life.stopping.wait()
    assert signal.getsignal(signal.SIGTERM) is _previous


async def test_serve_puts_the_signal_handlers_back_when_it_returns(
    own_sigterm: None, tmp_path: Path
) -> None:
    """`serve` stops on SIGTERM and, once it returns, SIGTERM has its handler from before."""
    async with fleet(SimConfig()) as sims:
        config = gateway_config.load(
            write_config(tmp_path, [s.url for s in sims], sections={"gateway": {"drain_delay": 0}})
        )
        ready = asyncio.Event()
        serving = asyncio.create_task(serve(config, on_ready=lambda url: ready.set()))
        async with asyncio.timeout(20):
            await ready.wait()
            os.kill(os.getpid(), signal.SIGTERM)
            await serving
    assert signal.getsignal(signal.SIGTERM) is _previous
