"""An instance's answer passed on to the client, once an attempt has one.

`relay` (whole answers; a stream's first token, then its commit), `splice` (the one way a
committed stream is relayed: socket to socket, with flow control both ways),
`client_stream` (the one writer of a committed stream: head, events, framing, end), `sse` (the
pure event framer), `records` (the values a relay returns), `continuation` (what a broken
stream sent, the request that continues it, and its events rewritten into one stream).
May import: the vocabulary, `gateway.dispatch`, `gateway.config`, `gateway.upstream`,
`gateway.observe`, `gateway.fleet`.
"""
