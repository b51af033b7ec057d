"""Instance URLs: where one connects, one spelling per machine, and what is a valid one."""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

LOOPBACK = "loopback"


def without_credentials(text: str) -> str:
    """`text` with a URL's user and password masked (a config error, a config dump)."""
    if "://" not in text or "@" not in text:
        return text
    scheme, _, rest = text.partition("://")
    netloc, slash, path = rest.partition("/")
    if "@" not in netloc:
        return text
    return f"{scheme}://***@{netloc.rpartition('@')[2]}{slash}{path}"


def endpoint(url: str) -> tuple[str, int]:
    """Where an http(s) URL connects: its host (as `host_key` gives it) and port.

    The port is the scheme's default when the URL names none.
    """
    parts = urlsplit(url)
    return host_key(parts.hostname or ""), parts.port or (443 if parts.scheme == "https" else 80)


def host_key(host: str) -> str:
    """A host name or address, normalised: one spelling for one machine.

    Lower case, no trailing dot, an IP address in its compressed form (an IPv4-mapped
    IPv6 address as IPv4); localhost, 127.0.0.0/8 and ::1 all become `LOOPBACK`.
    """
    host = host.lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):  # RFC 6761: always loopback
        return LOOPBACK
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        address = address.ipv4_mapped
    return LOOPBACK if address.is_loopback else address.compressed


def is_address(host: str) -> bool:
    """Whether `host` is an IP address rather than a name."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def check_http_url(value: str) -> None:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("expected an http:// or https:// URL with a host")
    if parts.query or parts.fragment:
        raise ValueError(f"the URL {value!r} must not carry a query or fragment")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as exc:
        raise ValueError(f"bad port in URL {value!r}") from exc
