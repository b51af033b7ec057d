"""The operator's routes, `/admin/*`: the fleet as the dispatcher sees it, drains and
resumes, the configuration running now, each key's use.

With `admin_port` they are served on the admin listener only (middleware.split_listeners).
May import: `gateway.server.resources`, `gateway.server.redact`, `gateway.server.usage`
and every package below `gateway.server`.
"""

from __future__ import annotations

import datetime
import json
import time
from typing import Any

from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from gateway import errors
from gateway.config.urls import without_credentials
from gateway.dispatch.kv_index import KvView
from gateway.fleet.discovery import host_port
from gateway.fleet.drains import UnknownInstance
from gateway.proxy import tenants
from gateway.server import redact, usage
from gateway.server.resources import DISCOVERY, DISPATCHER, DRAINS, METRICS, PEERS, PROXY


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_get("/admin/instances", _admin_instances)
    router.add_post("/admin/instances/{server}/drain", _admin_drain)
    router.add_post("/admin/instances/{server}/resume", _admin_resume)
    router.add_get("/admin/config", _admin_config)
    router.add_get("/admin/usage", _admin_usage)


async def _admin_config(request: web.Request) -> web.StreamResponse:
    """The configuration running now (nginx -T, Envoy's /config_dump), secrets redacted:
    both files as validated, their digest, when they were loaded and any setting a reload
    read but left for a restart."""
    proxy = request.app[PROXY]
    config = proxy.config
    body = {
        "digest": config.digest(),
        "loaded_at": proxy.loaded_at,
        "config_path": config.config_path,
        "settings_path": config.settings_path,
        "waiting_for_restart": proxy.waiting_for_restart,
        "keys": len(config.api_keys) + len(config.named_keys),
    }
    body["config"], body["settings"] = redact.config_dump(config)  # server/redact.py
    return web.json_response(body)


async def _admin_usage(request: web.Request) -> web.StreamResponse:
    """Each key's use since start (every worker's with --workers), its limits and what is
    left of them now (server/usage.py)."""
    proxy = request.app[PROXY]
    peers = request.app.get(PEERS)
    if peers is not None:
        text = (await peers.exposition()).decode()
        families = list(text_string_to_metric_families(text))
    else:
        families = list(request.app[METRICS].registry.collect())
    configured = tenants.tenants_of(proxy.config)
    standings = {t.name: await proxy.limiter.standings(t) for t in configured if t.limits.any}
    body = usage.report(configured, families, standings)
    return web.Response(text=json.dumps(body, indent=2), content_type="application/json")


async def _admin_drain(request: web.Request) -> web.StreamResponse:
    return await _drain_order(request, drained=True)


async def _admin_resume(request: web.Request) -> web.StreamResponse:
    return await _drain_order(request, drained=False)


async def _drain_order(request: web.Request, *, drained: bool) -> web.StreamResponse:
    """Take `{server}` out of rotation or back in (fleet/drains.py); idempotent."""
    name = request.match_info["server"]
    try:
        order = await request.app[DRAINS].order(name, drained)
    except UnknownInstance:
        known = sorted(request.app[DISPATCHER].instance_names())
        raise errors.InstanceNotFound(
            f"no instance named {name!r}: the fleet holds {known} (GET /admin/instances)",
            param="server",
        ) from None
    if order is None:
        raise errors.SharedStoreUnavailable(
            "the shared store (Redis) did not take the order, so no replica applies it: "
            "nothing changed; try again"
        )
    since = order.since
    body = {
        "name": name,
        "drained": since is not None,
        "drained_since": None if since is None else _iso(since),
        "fleet_wide": request.app[DRAINS].store is not None,
    }
    return web.json_response(body)


def _iso(wall: float) -> str:
    return datetime.datetime.fromtimestamp(wall, datetime.UTC).isoformat(timespec="seconds")


def _kv_view(kv: KvView, wall: float) -> dict[str, Any]:
    """An instance's KV events index: whether dispatch reads its cache from it, and why."""
    age = kv.last_event_age
    return {
        "index": kv.state,  # whole | partial | stale | waiting (kv_index.py)
        "blocks": kv.blocks,
        "block_size": kv.block_size,
        "next_seq": kv.next_seq,
        "last_event_at": None if age is None else _iso(wall - age),
        "batches_total": kv.batches_total,
        "events_total": kv.events_total,
        "gaps_total": kv.gaps_total,
        "replays_total": kv.replays_total,
        "replays_failed_total": kv.replays_failed_total,
        "malformed_total": kv.malformed_total,
        "unchained_blocks_total": kv.unchained_total,
        "stale_total": kv.stale_total,
    }


async def _admin_instances(request: web.Request) -> web.StreamResponse:
    snap = request.app[DISPATCHER].snapshot()
    wall = time.time()  # the snapshot's ages, as times an operator can read
    # The long lane is named by [prefill].tag here too, as in metrics and logs.
    lane_names = {lane.value: name for lane, name in request.app[METRICS].lane_names.items()}
    instances: list[dict[str, Any]] = []
    for i in snap.instances:
        report = i.report
        instances.append(
            {
                "name": i.name,
                "state": i.verdict,
                "state_since": None if i.verdict_for is None else _iso(wall - i.verdict_for),
                "available": i.available,
                "drained": i.drained_since is not None,
                "drained_since": None if i.drained_since is None else _iso(i.drained_since),
                "ejected_for_s": None if i.ejected_for is None else round(i.ejected_for, 1),
                "lane": lane_names.get(i.lane, i.lane),
                "role": i.role,
                "weight": i.weight,
                "slots": i.slots,
                "learned_slots": i.learned_slots,
                "models": None if i.models is None else sorted(i.models),
                "models_pinned": i.pinned_models is not None,
                "prefix_index_blocks": i.prefix_index_blocks,
                "prefix_estimated_hit_ratio": round(i.prefix_hit_tokens / i.prefix_query_tokens, 4)
                if i.prefix_query_tokens
                else None,
                "inflight": i.inflight,
                "peers_inflight": i.peers_inflight,
                "peers_pending_prefill_tokens": i.peers_pending_prefill_tokens,
                "long_prefilling": i.long_prefilling,
                "queue_depth": i.queue_depth,
                "score": round(i.score, 4),
                "load_fresh": i.load_fresh,
                "vllm": None
                if report is None
                else {
                    "running": report.running,
                    "waiting": report.waiting,
                    "kv_cache_usage": report.kv_usage,
                    "age_s": round(snap.at - report.at, 1),
                },
                "assigned_total": i.assigned_total,
                "failures_total": i.failures_total,
                "consecutive_failures": i.consecutive_failures,
                "probe_failures_total": i.probe_failures_total,
                "consecutive_probe_failures": i.consecutive_probe_failures,
                "ejections_total": i.ejections_total,
                "recent_errors": [
                    {"at": _iso(wall - ago), "error": error} for ago, error in i.recent_errors
                ],
                "kv_events": None if i.kv is None else _kv_view(i.kv, wall),
            }
        )
    queues = {lane_names[lane.value]: n for lane, n in snap.queues.items()}
    discovery = request.app[DISCOVERY]
    body = {
        "strategy": snap.strategy,
        "inflight": snap.inflight,
        "instances": instances,
        "queues": queues,
        "discovery": [
            {
                "entry": without_credentials(entry.url),
                "addresses": [host_port(a) for a in state.addresses],
                "resolved_at": None if state.resolved_at is None else _iso(state.resolved_at),
                "empty_answers_in_a_row": state.empty_rounds,
                "error": state.error,
                "failing_since": None if state.failing_since is None else _iso(state.failing_since),
                "failures_total": state.failures_total,
            }
            for entry, state in discovery.entry_states()
        ],
    }
    return web.Response(text=json.dumps(body, indent=2), content_type="application/json")
