"""The aiohttp server: the app and its routes, client connections, the middleware order.

`app` (the composition root: builds the application and owns its resources),
`resources` (the typed `AppKey`s the handlers reach those through), the routes by concept:
`api_routes` (the proxied routes and the model list), `probe_routes` (`/healthz`,
`/readyz`, `/metrics`), `admin_routes` (`/admin/*`, with `usage`: what /admin/usage shows,
and `redact`: the configuration dump's secrets), `runner` (the listener and aiohttp's
own errors in OpenAI's shape), `connections` (limits and timeouts per client connection),
`middleware` (request id, recording, errors, trace, key, in that order).
May import: every package below it, up to `gateway.proxy`.
"""
