"""What the gateway reads from an instance's /metrics: load, prefix counters, cache size."""

from __future__ import annotations

import pytest
from fakes import fleet, gateway_with

from gateway.dispatch.affinity import BLOCK_TOKENS
from gateway.fleet.probes import parse_vllm_metrics
from gateway.sim.sim_vllm import SimConfig


@pytest.mark.parametrize(
    ("labels", "tokens"),
    [
        ('block_size="16",enable_prefix_caching="True",num_gpu_blocks="4000"', 64000),
        ('block_size="16",enable_prefix_caching="False",num_gpu_blocks="4000"', 0),
        ('block_size="16",num_gpu_blocks="x"', None),
    ],
)
def test_cache_config_info_is_read_from_metrics(labels: str, tokens: int | None) -> None:
    """The KV cache's size in tokens comes from vllm:cache_config_info's labels."""
    text = (
        "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1.0\n"
        "# TYPE vllm:cache_config_info gauge\n"
        f"vllm:cache_config_info{{{labels}}} 1.0\n"
    )
    load = parse_vllm_metrics(text)
    assert load is not None
    assert load.cache_tokens == tokens


async def test_the_gateway_sizes_each_index_from_the_instances_cache() -> None:
    """A simulated instance with 100 cached 16-token blocks gets an index of 25 64-token ones."""
    async with (
        fleet(SimConfig(prefix_cache_blocks=100), SimConfig()) as sims,
        gateway_with(sims) as gw,
    ):
        cached, off = gw.dispatcher.scheduler.instances.states
        assert cached.cache.capacity == 100 * 16 // BLOCK_TOKENS
        assert off.cache.capacity == 0  # its prefix caching is off: nothing to remember
