"""The app's resources as typed `AppKey`s: how a route handler reaches what the app owns.

The composition root (app.py) creates each resource and hangs it here; the route modules
(api_routes.py, probe_routes.py, admin_routes.py) and the process layer read them. No
resource lives at module level: these are keys, not values.
May import: what the resources are, from every package below `gateway.server`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from gateway.config.load import Config
from gateway.fleet.discovery import Discovery
from gateway.fleet.dispatcher import Dispatcher
from gateway.fleet.drains import Drains
from gateway.fleet.kv_events import KvListeners
from gateway.fleet.probes import Prober
from gateway.lifecycle import Lifecycle
from gateway.observe.metrics import Metrics
from gateway.observe.peer_metrics import PeerMetrics
from gateway.proxy.handler import Proxy
from gateway.proxy.tokenizer import TokenCounter
from gateway.upstream.client import Upstream

if TYPE_CHECKING:
    from gateway.fleet.shared import SharedState


CONFIG = web.AppKey("config", Config)
LIFECYCLE = web.AppKey("lifecycle", Lifecycle)
PROXY = web.AppKey("proxy", Proxy)
UPSTREAM = web.AppKey("upstream", Upstream)
TOKEN_COUNTER = web.AppKey("token_counter", TokenCounter)
DISPATCHER = web.AppKey("dispatcher", Dispatcher)
PROBER = web.AppKey("prober", Prober)
DRAINS = web.AppKey("drains", Drains)
DISCOVERY = web.AppKey("discovery", Discovery)
KV_LISTENERS = web.AppKey("kv_listeners", KvListeners)
METRICS = web.AppKey("metrics", Metrics)
# redis-py is imported only with `[shared]`: it pulls in OpenTelemetry's SDK where that is
# installed, which a gateway without tracing or sharing should not load.
SHARED: web.AppKey[SharedState] = web.AppKey("shared")
PEERS = web.AppKey("peers", PeerMetrics)


class AdminListener:
    """The admin listener's bound port, once it listens (None: there is none)."""

    port: int | None = None


ADMIN = web.AppKey("admin", AdminListener)
