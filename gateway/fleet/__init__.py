"""The core's shell: what feeds the pure scheduler and waits on it.

`dispatcher` (queue waits and leases around `gateway.dispatch.Scheduler`), `probes`
(health probes, `/metrics` and `/v1/models` scrapes), `shared` and `shared_codec` (the
view of the other processes' load through Redis: `SharedState`, the entry point),
`shared_link` (the one connection to Redis, its failures counted), `shared_placements`
(the prefix placements stream), `shared_leases` (strict caps' leases), `shared_limits`
(the named keys' counters in Redis), `inputs` (what the config makes of the fleet),
`discovery` (instances found by DNS), `drains` (the operator's drains: which instances are
out of rotation), `kv_events` and `kv_wire` (a ZMQ listener per instance for vLLM's KV
cache events, and their two wire forms decoded).
May import: the vocabulary, `gateway.dispatch`, `gateway.config`, `gateway.upstream`,
`gateway.observe`.
"""
