"""The aiohttp server: the app and its routes, client connections, the middleware order.

`app` (builds the application and owns its resources), `usage` (what /admin/usage shows),
`runner` (the listener and aiohttp's
own errors in OpenAI's shape), `connections` (limits and timeouts per client connection),
`middleware` (request id, recording, errors, trace, key, in that order).
May import: every package below it, up to `gateway.proxy`.
"""
