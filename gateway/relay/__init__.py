"""An instance's answer passed on to the client, once an attempt has one.

`relay` (whole answers, the first event, the committed stream), `splice` (socket to socket
once committed, with flow control both ways), `sse` (the pure event framer), `records`
(the values a relay returns).
May import: the vocabulary, `gateway.dispatch`, `gateway.config`, `gateway.upstream`,
`gateway.observe`, `gateway.fleet`.
"""
