"""Who sent a request, behind load balancers: the address the access log calls `client`.

The peer of a connection is the client unless it is a proxy we trust (`[gateway]
trusted_proxies`, CIDRs). Then the client is named by `X-Forwarded-For` or, without it,
`Forwarded` (RFC 7239): X-Forwarded-For first, because it is what load balancers append
(nginx, Envoy, cloud balancers) while most pass a client's own `Forwarded` through
untouched, which would let the client name itself. Each proxy appends the address it got
the request from, so the list is read from the right, skipping the proxies we trust, and
the first address that is not one is the client (anything to its left was written by the
client itself and proves nothing). A value that is not an address (`unknown`, an
obfuscated `_node`) stops the walk there: the client is then the last trusted hop's
peer, as nginx's realip does. Pure: strings in, a string out.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def networks(cidrs: Sequence[str]) -> tuple[Network, ...]:
    """The trusted networks, parsed once (ValueError names a bad one)."""
    return tuple(ipaddress.ip_network(cidr, strict=False) for cidr in cidrs)


def _address(token: str) -> Address | None:
    value = token.strip().strip('"')
    if value.startswith("["):  # [v6]:port
        value = value[1 : value.find("]")] if "]" in value else ""
    elif value.count(":") == 1:  # v4:port
        value = value.partition(":")[0]
    try:
        return ipaddress.ip_address(value)
    except ValueError:
        return None


def _hops(forwarded: str | None, x_forwarded_for: str | None) -> list[str]:
    """The addresses the proxies recorded, oldest first."""
    if x_forwarded_for:
        return [part for part in x_forwarded_for.split(",") if part.strip()]
    if forwarded:
        hops = []
        for element in forwarded.split(","):
            for pair in element.split(";"):
                name, _, value = pair.strip().partition("=")
                if name.lower() == "for":
                    hops.append(value)
        return hops
    return []


def client_of(
    peer: str,
    trusted: tuple[Network, ...],
    forwarded: str | None,
    x_forwarded_for: str | None,
) -> str:
    """The client's address: `peer`, or what trusted proxies say it was."""
    if not trusted:
        return peer
    client = _address(peer)
    if client is None or not any(client in net for net in trusted):
        return peer
    for hop in reversed(_hops(forwarded, x_forwarded_for)):
        address = _address(hop)
        if address is None:
            break
        client = address
        if not any(address in net for net in trusted):
            break
    return str(client)
