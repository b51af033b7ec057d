"""A DNS server the tests control, on a loopback UDP port: SRV records from a table, NXDOMAIN
for other names, SERVFAIL while `failing`. Built with dnspython's message API (the `dns`
extra), so the gateway's SRV lookup talks real DNS to it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import dns.asyncresolver
import dns.message
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset


@dataclass
class DnsServer:
    # name (absolute, with the final dot) -> (priority, weight, port, target) records
    srv: dict[str, list[tuple[int, int, int, str]]] = field(default_factory=dict)
    failing: bool = False
    port: int = 0
    queries: list[str] = field(default_factory=list)

    def answer(self, wire: bytes) -> bytes:
        query = dns.message.from_wire(wire)
        response = dns.message.make_response(query)
        question = query.question[0]
        name = question.name.to_text()
        self.queries.append(name)
        records = self.srv.get(name)
        if self.failing:
            response.set_rcode(dns.rcode.SERVFAIL)
        elif records is None or question.rdtype != dns.rdatatype.SRV:
            response.set_rcode(dns.rcode.NXDOMAIN)
        else:
            texts = [f"{p} {w} {port} {target}" for p, w, port, target in records]
            response.answer.append(
                dns.rrset.from_text_list(name, 30, dns.rdataclass.IN, dns.rdatatype.SRV, texts)
            )
        return response.to_wire()

    def resolver(self) -> dns.asyncresolver.Resolver:
        """A dnspython resolver that asks this server only, with no search domains."""
        resolver = dns.asyncresolver.Resolver(configure=False)
        resolver.nameservers = ["127.0.0.1"]
        resolver.port = self.port
        resolver.lifetime = 2.0
        return resolver


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self, server: DnsServer) -> None:
        self.server = server
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a datagram endpoint's

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        assert self.transport is not None
        self.transport.sendto(self.server.answer(data), addr)


@contextlib.asynccontextmanager
async def dns_server() -> AsyncIterator[DnsServer]:
    server = DnsServer()
    transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
        lambda: _Protocol(server), local_addr=("127.0.0.1", 0)
    )
    server.port = transport.get_extra_info("sockname")[1]
    try:
        yield server
    finally:
        transport.close()
