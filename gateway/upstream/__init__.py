"""The client side toward the instances: the only code that opens a socket to one.

`response` (the seam: `UpstreamResponse` and `AttemptFailed`, which the rest of the gateway
reads instead of any transport type), `connection` (our HTTP/1.1 client protocol on
httptools, http and https), `pool` (its keep-alive pool), `client` (`Upstream`, the one
entry point: requests on one pool, probes and scrapes on a small one), `endpoint` (where
an instance's requests go).
May import: the vocabulary, `gateway.dispatch`, `gateway.config`.
"""
