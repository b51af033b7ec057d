"""SIGHUP reloads config.toml and settings.json in the real process, without dropping a request.

One scenario runs once for the module: a gateway in front of instance A; 10 streams
start; the files are rewritten to add instance B and rotate the key, and SIGHUP lands in
the middle of every stream. Then a second reload removes A (and asks for a new port,
which needs a restart), and a third finds a broken settings.json. The tests read what
clients saw, which instance served what, and the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from fakes import KEY, write_config
from faultproxy import eventually
from test_shutdown import ROOT, SIM, Outcome, _listening_url, _read, _stream

from gateway.sim.sim_vllm import SimInstance

NEW_KEY = "sk-rotated-key"
STREAMS = 10
TOKENS = 60  # about 2 s at 30 ms a token: the reload lands in the middle of every stream
SECTIONS: dict[str, dict[str, Any]] = {
    "gateway": {"drain_timeout": 3, "drain_delay": 0},
    "dispatch": {"health_check_interval": 60},  # only a reload's own round probes B
}


@dataclass
class Reload:
    streams: list[Outcome]
    old_key_status: int = 0  # after the first reload
    new_key_status: int = 0
    to_b_after_add: int = 0  # requests B got after it was added
    on_removed: list[Outcome] = field(default_factory=list)  # streams running as A is removed
    to_a_after_remove: int = 0  # requests A got after it was removed
    to_b_after_remove: int = 0
    after_broken_status: int = 0  # a request after the broken reload (new key)
    events: list[dict[str, Any]] = field(default_factory=list)
    exit_code: int | None = None
    log: str = ""
    metrics: str = ""  # /metrics after the broken reload


def _events(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if isinstance(event, dict):
                out.append(event)
    return out


async def _hup(proc: asyncio.subprocess.Process, log: Path, event: str, count: int) -> None:
    """Send SIGHUP and wait until the log holds `count` events named `event`."""
    proc.send_signal(signal.SIGHUP)
    for _ in range(200):
        if sum(e.get("event") == event for e in _events(await _read(log))) >= count:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"no {event} after SIGHUP: {(await _read(log))[-2000:]}")


async def _statuses(url: str, key: str, n: int) -> list[int]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=10)
    out = []
    async with client:
        for _ in range(n):
            try:
                raw = await client.chat.completions.with_raw_response.create(
                    model="sim-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
                out.append(raw.status_code)
            except openai.APIStatusError as exc:
                out.append(exc.status_code)
    return out


async def _instances_up(url: str) -> int:
    async with aiohttp.ClientSession() as s, s.get(url + "/readyz") as resp:
        return int((await resp.json())["instances_up"])


async def _scenario(folder: Path) -> Reload:
    a, b = SimInstance(SIM), SimInstance(SIM)
    await a.start()
    await b.start()
    log = folder / "gateway.log"
    try:
        config = write_config(folder, [a.url], sections=SECTIONS)
        env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
        with log.open("wb") as sink:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "gateway", "--config", str(config),
                cwd=ROOT, env=env, stdout=sink, stderr=asyncio.subprocess.STDOUT,
            )  # fmt: skip
        try:
            return await _drive(proc, await _listening_url(log, proc), folder, log, a, b)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    finally:
        await a.stop()
        await b.stop()


async def _drive(
    proc: asyncio.subprocess.Process,
    url: str,
    folder: Path,
    log: Path,
    a: SimInstance,
    b: SimInstance,
) -> Reload:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=30)
    async with client:
        streams = [Outcome("reload") for _ in range(STREAMS)]
        tasks = [asyncio.create_task(_stream(client, o, TOKENS)) for o in streams]
        await eventually(lambda: all(o.first_token_at for o in streams), timeout=20)
        write_config(folder, [a.url, b.url], sections=SECTIONS, channel={"api_key": NEW_KEY})
        await _hup(proc, log, "reloaded", 1)
        async with asyncio.timeout(30):
            await asyncio.gather(*tasks)
    out = Reload(streams)
    for _ in range(100):  # the reload's own health round brings B up
        if await _instances_up(url) == 2:
            break
        await asyncio.sleep(0.05)
    out.old_key_status = (await _statuses(url, KEY, 1))[0]
    out.new_key_status = (await _statuses(url, NEW_KEY, 1))[0]
    b_before = b.stats.requests
    await _statuses(url, NEW_KEY, 10)
    out.to_b_after_add = b.stats.requests - b_before
    moved = {**SECTIONS, "gateway": {**SECTIONS["gateway"], "port": 1}}
    write_config(folder, [b.url], sections=moved, channel={"api_key": NEW_KEY})
    a_running = a.stats.requests
    fresh = openai.AsyncOpenAI(base_url=url + "/v1", api_key=NEW_KEY, max_retries=0, timeout=30)
    async with fresh:
        out.on_removed = [Outcome("removed") for _ in range(6)]
        tasks = [asyncio.create_task(_stream(fresh, o, TOKENS)) for o in out.on_removed]
        await eventually(lambda: all(o.first_token_at for o in out.on_removed), timeout=20)
        assert a.stats.requests > a_running, "no stream went to A before its removal"
        await _hup(proc, log, "reloaded", 2)
        async with asyncio.timeout(30):
            await asyncio.gather(*tasks)
    a_before, b_before = a.stats.requests, b.stats.requests
    await _statuses(url, NEW_KEY, 10)
    out.to_a_after_remove = a.stats.requests - a_before
    out.to_b_after_remove = b.stats.requests - b_before
    (folder / "settings.json").write_text('{"vllm": {"instances": [')
    await _hup(proc, log, "reload_failed", 1)
    out.after_broken_status = (await _statuses(url, NEW_KEY, 1))[0]
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as resp:
        out.metrics = await resp.text()
    proc.send_signal(signal.SIGTERM)
    async with asyncio.timeout(15):
        out.exit_code = await proc.wait()
    out.log = await _read(log)
    out.events = _events(out.log)
    return out


@pytest.fixture(scope="module")
def reload(tmp_path_factory: pytest.TempPathFactory) -> Reload:
    return asyncio.run(_scenario(tmp_path_factory.mktemp("reload")))


def _named(r: Reload, name: str) -> list[dict[str, Any]]:
    return [e for e in r.events if e.get("event") == name]


def test_streams_in_flight_through_a_reload_all_complete(reload: Reload) -> None:
    """Streams running when SIGHUP arrives all finish with every token and `[DONE]`."""
    broken = [(o.error, o.lines[-2:]) for o in reload.streams if not o.done or o.in_band_error]
    assert not broken, (broken[:3], reload.log[-2000:])
    tokens = [len([ln for ln in o.lines if ln.startswith('data: {"id"')]) for o in reload.streams]
    assert min(tokens) >= TOKENS, tokens


def test_a_rotated_key_works_and_the_old_one_is_refused(reload: Reload) -> None:
    """After a reload that changes the key, the new key is served and the old one gets 401."""
    assert reload.new_key_status == 200, reload.log[-2000:]
    assert reload.old_key_status == 401


def test_an_added_instance_gets_traffic(reload: Reload) -> None:
    """An instance added by a reload is probed at once and then takes requests."""
    assert reload.to_b_after_add > 0
    first = _named(reload, "reloaded")[0]
    assert len(first["instances_added"]) == 1
    assert first["instances_removed"] == []
    assert "channel.api_key" in first["changed"]
    assert "vllm.instances" in first["changed"]


def test_a_removed_instance_gets_no_traffic_after(reload: Reload) -> None:
    """After a reload removes an instance, every request goes to the ones left."""
    assert reload.to_a_after_remove == 0
    assert reload.to_b_after_remove == 10
    assert len(_named(reload, "reloaded")[1]["instances_removed"]) == 1


def test_streams_on_a_removed_instance_finish(reload: Reload) -> None:
    """Streams running on an instance when a reload removes it finish normally."""
    broken = [(o.error, o.lines[-2:]) for o in reload.on_removed if not o.done or o.in_band_error]
    assert not broken, (broken[:3], reload.log[-2000:])


def test_a_setting_that_needs_a_restart_is_logged_and_kept(reload: Reload) -> None:
    """A new port in the file is logged as reload_needs_restart; the gateway keeps serving."""
    needs = _named(reload, "reload_needs_restart")
    assert len(needs) == 1
    assert needs[0]["settings"] == ["gateway.port"]
    assert reload.to_b_after_remove == 10  # served on the old port after it


def test_a_broken_file_keeps_the_old_configuration(reload: Reload) -> None:
    """A reload of an invalid settings.json logs reload_failed with why, and changes nothing."""
    failed = _named(reload, "reload_failed")
    assert len(failed) == 1
    assert "settings.json" in failed[0]["error"]
    assert "invalid JSON" in failed[0]["error"]
    assert reload.after_broken_status == 200
    assert len(_named(reload, "reloaded")) == 2


def test_reloads_are_counted_and_the_failed_one_flagged(reload: Reload) -> None:
    """/metrics counts two applied reloads and one failed, and flags the last as failed."""
    samples = dict(
        line.rsplit(" ", 1)
        for line in reload.metrics.splitlines()
        if line.startswith("gateway_config")
    )
    assert float(samples['gateway_config_reloads_total{result="applied"}']) == 2
    assert float(samples['gateway_config_reloads_total{result="failed"}']) == 1
    assert float(samples["gateway_config_last_reload_successful"]) == 0


def test_the_process_still_exits_0_on_sigterm(reload: Reload) -> None:
    """After the reloads, SIGTERM still drains and exits 0."""
    assert reload.exit_code == 0, reload.log[-2000:]


def test_reloads_log_no_other_error(reload: Reload) -> None:
    """Besides the broken file's reload_failed, the log holds no error and no traceback."""
    errors = [e for e in reload.events if e.get("level") in ("error", "critical")]
    assert [e["event"] for e in errors] == ["reload_failed"], errors[:3]
    assert "Traceback" not in reload.log
