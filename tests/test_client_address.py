"""The client's address behind trusted proxies (observe/client_address.py)."""

from __future__ import annotations

import pytest

from gateway.observe.client_address import client_of, networks

LB = networks(["10.0.0.0/8", "fd00::/8"])


@pytest.mark.parametrize(
    ("peer", "forwarded", "xff", "client"),
    [
        ("203.0.113.9", None, "198.51.100.1", "203.0.113.9"),  # peer not trusted: ignore
        ("10.1.2.3", None, "198.51.100.1", "198.51.100.1"),
        ("10.1.2.3", None, "6.6.6.6, 198.51.100.1, 10.9.9.9", "198.51.100.1"),  # spoof left
        ("10.1.2.3", None, "10.2.2.2, 10.9.9.9", "10.2.2.2"),  # all trusted: the oldest
        ("10.1.2.3", None, None, "10.1.2.3"),
        ("10.1.2.3", 'for="[2001:db8::1]:4711";proto=https', None, "2001:db8::1"),
        ("10.1.2.3", "for=6.6.6.6", "198.51.100.1", "198.51.100.1"),  # the client's Forwarded
        ("10.1.2.3", "for=192.0.2.60;by=10.1.2.3, for=10.5.5.5", None, "192.0.2.60"),
        ("10.1.2.3", None, "198.51.100.1:5555", "198.51.100.1"),
        ("10.1.2.3", "for=unknown", None, "10.1.2.3"),  # not an address: the walk stops
        ("fd00::5", None, "2001:db8::7", "2001:db8::7"),
    ],
)
def test_the_client_is_the_first_untrusted_hop_from_the_right(
    peer: str, forwarded: str | None, xff: str | None, client: str
) -> None:
    """Read right to left through trusted proxies; what the client wrote proves nothing."""
    assert client_of(peer, LB, forwarded, xff) == client


def test_without_trusted_proxies_the_headers_are_ignored() -> None:
    """The default: the peer, whatever the request claims."""
    assert client_of("10.1.2.3", (), None, "198.51.100.1") == "10.1.2.3"


def test_a_bad_cidr_is_refused() -> None:
    """A typo in the setting is an error, not a silently empty list."""
    with pytest.raises(ValueError, match="does not appear"):
        networks(["10.0.0.0/33x"])
