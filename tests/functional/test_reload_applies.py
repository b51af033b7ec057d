"""A reload reaches every component it changes: each takes its own part of the new
configuration through its `apply`, read here from the component's own fields."""

from __future__ import annotations

from pathlib import Path

from fakes import fleet, write_config
from test_key_reload import serving

from gateway.dispatch import Lane
from gateway.process.reload import reload
from gateway.server.resources import PROXY, TOKEN_COUNTER, UPSTREAM
from gateway.sim.sim_vllm import SimConfig

BEFORE = {"connect": 2, "read": 10, "write": 5}
AFTER = {"connect": 0.5, "read": 20, "write": 7}


async def test_a_reload_gives_the_upstream_pool_the_new_connect_timeout(tmp_path: Path) -> None:
    """The requests' pool bounds new connections by the reloaded `channel.timeout.connect`
    at once, with no request in between to carry it there."""
    async with fleet(SimConfig(instant=True)) as sims:
        urls = [s.url for s in sims]
        path = write_config(tmp_path, urls, channel={"timeout": BEFORE})
        async with serving(path) as (_, app):
            upstream = app[UPSTREAM]
            assert upstream.pool is not None
            assert upstream.pool.connect_timeout == 2
            write_config(tmp_path, urls, channel={"timeout": AFTER})
            assert reload(app)
            assert upstream.timeouts.connect == upstream.pool.connect_timeout == 0.5


async def test_a_reload_reaches_the_relay_the_counter_and_the_recorder(tmp_path: Path) -> None:
    """The relay's write timeout, the token counter's long-lane threshold and the proxies
    the recorder trusts are the reloaded ones, as the proxy's own read timeout is."""
    async with fleet(SimConfig(instant=True)) as sims:
        urls = [s.url for s in sims]
        path = write_config(tmp_path, urls, channel={"timeout": BEFORE})
        async with serving(path) as (_, app):
            proxy, counter = app[PROXY], app[TOKEN_COUNTER]
            assert (proxy.relay.write_timeout, counter.threshold) == (5, 4096)
            assert proxy.recorder.trusted == ()
            sections = {
                "prefill": {"long_input_threshold": 1000},
                "gateway": {"trusted_proxies": ["10.0.0.0/8"]},
            }
            write_config(tmp_path, urls, sections=sections, channel={"timeout": AFTER})
            assert reload(app)
            assert (proxy.relay.write_timeout, counter.threshold) == (7, 1000)
            assert proxy.threshold == 1000
            assert [str(n) for n in proxy.recorder.trusted] == ["10.0.0.0/8"]
            assert proxy.ttft_allowance[Lane.SHORT] == 20
