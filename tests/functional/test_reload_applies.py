"""A reload reaches every component it changes: each takes its own part of the new
configuration through its `apply`, read here from the component's own fields."""

from __future__ import annotations

from pathlib import Path

from fakes import fleet, write_config
from test_key_reload import serving

from gateway.process.reload import reload
from gateway.server.resources import UPSTREAM
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
