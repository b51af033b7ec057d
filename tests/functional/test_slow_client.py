"""A client that stops reading is let go after `timeout.write`, freeing its instance."""

from __future__ import annotations

import asyncio
import json
import socket

from fakes import KEY, fleet, gateway_with
from faultproxy import eventually

from gateway.sim.sim_vllm import SimConfig

# 30,000 tokens take the simulated instance at least 15 s to generate, far longer than the
# gateway needs to give up on the client (its small, fixed send buffer fills in well under
# a second); an instant instance would have written the whole answer into socket buffers
# by then, so "cancelled unfinished" could not be seen.
PACED = SimConfig(decode_s_per_token=0.0005, prefill_tokens_per_s=1e6)


async def test_client_that_stops_reading_is_dropped_after_the_write_timeout() -> None:
    """A stalled reader is dropped once its backlog waited `timeout.write` s: the drop is
    counted, in-flight returns to 0 and the instance sees its request cancelled unfinished."""
    async with (
        fleet(PACED) as sims,
        gateway_with(
            sims,
            channel={"timeout": {"connect": 2, "read": 10, "write": 0.5}},
            send_buffer=16384,
        ) as gw,
    ):
        sim = sims[0]
        host, port = gw.url.removeprefix("http://").split(":")
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
        body = json.dumps(
            {
                "prompt": "x",
                "max_tokens": 30000,
                "ignore_eos": True,  # the whole 30000: the stream outlasts the test
                "stream": True,
                "model": "sim-model",
            }
        ).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        await asyncio.get_running_loop().sock_sendall(sock, head + body)
        dropped = gw.metrics.stream_aborts.labels("client")
        try:
            await eventually(lambda: dropped._value.get() >= 1, 10, "the client dropped")
            await eventually(lambda: gw.dispatcher.snapshot().inflight == 0, 5, "in-flight 0")
            # Closing the upstream connection is what tells vLLM to abort the request; a
            # gateway that read the rest of the stream would let it run to completion.
            await eventually(lambda: sim.stats.cancelled == 1, 5, "the instance cancelled it")
        finally:
            sock.close()
        assert dropped._value.get() == 1
        assert sim.stats.requests == 1
        assert sim.stats.completed == 0
        assert sim.stats.generation_tokens < 30000
