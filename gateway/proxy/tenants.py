"""Who a request is: the named key it carries, the models that key may use, and its limits.

Each `channel.keys` entry is a tenant, known by its name; the unnamed keys (`api_key`,
`api_key_env`) are one tenant named `default`, with every model and no limits, and so is
every request to a gateway started --open. The auth middleware (auth.py) finds the key
among the digests and calls `identified`, which leaves the tenant on the request for the
handler and names it in the access line (its name, never its key). A reload builds a new
table (`key_checker`), so a key added, changed or revoked counts from the next request on.

A per-key setting is a field of `Tenant`, read from its `KeyEntry` in `tenant_of`: the
handler has the tenant of every request. Its priority is two things: its class in the
gateway's queue (dispatch.Priority) and the `priority` value vLLM's priority scheduler
reads (lower first), which the proxy writes for instances that run it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web

from gateway import errors
from gateway.config.load import Config
from gateway.config.schema import UNNAMED_KEY, KeyEntry
from gateway.dispatch import Priority
from gateway.dispatch.key_limits import KeyLimits
from gateway.observe.recorder import EXCHANGE
from gateway.proxy.auth import KeyChecker

_MODEL_CHARS = 100  # of a requested model quoted back in an error
ADMIN_PATHS = "/admin/"  # the operator's routes (server/app.py)


@dataclass(frozen=True)
class Tenant:
    """A configured key, by its name: the models it may use (None: any) and its limits."""

    name: str
    models: frozenset[str] | None = None
    limits: KeyLimits = field(default_factory=KeyLimits)
    admin: bool = False  # may read /admin/*: the operator's unnamed keys, or `admin` set
    priority: Priority = Priority.INTERACTIVE
    vllm_priority: int = 0  # vLLM's own value: interactive 0, batch 1, or the key's number
    share: float = 1.0  # its fair share of a saturated fleet (dispatch/fairness.py)

    def check_model(self, model: str | None) -> None:
        """403 unless the key may use `model` (naming none, when it is restricted, is not
        allowed either: the instance would pick one)."""
        if self.models is None or model in self.models:
            return
        allowed = ", ".join(sorted(self.models))
        named = f"model {model[:_MODEL_CHARS]!r}" if model is not None else "no model"
        raise errors.ModelNotAllowed(
            f"the key {self.name!r} does not have access to {named}; it may use: {allowed}",
            param="model",
        )


DEFAULT = Tenant(UNNAMED_KEY, admin=True)
TENANT = web.RequestKey("tenant", Tenant)


def tenant_of(entry: KeyEntry) -> Tenant:
    models = frozenset(entry.models) if entry.models is not None else None
    limits = KeyLimits(entry.requests_per_minute, entry.tokens_per_minute, entry.max_concurrent)
    priority, vllm_priority = priority_of(entry.priority)
    return Tenant(entry.name, models, limits, entry.admin, priority, vllm_priority, entry.share)


def priority_of(setting: str | int) -> tuple[Priority, int]:
    """A key's `priority` as its class and vLLM's value: a number is vLLM's own, and above
    0 (vLLM's default) it runs after the default, so it is the batch class here.

    >>> priority_of("batch"), priority_of(-5)
    ((<Priority.BATCH: 'batch'>, 1), (<Priority.INTERACTIVE: 'interactive'>, -5))
    """
    if isinstance(setting, str):
        priority = Priority(setting)
        return priority, int(priority is Priority.BATCH)
    return (Priority.BATCH if setting > 0 else Priority.INTERACTIVE), setting


def tenants_of(config: Config) -> list[Tenant]:
    """Every tenant the configuration names: `default` first if it has unnamed keys (or
    none at all: --open), then each named key in order."""
    named = [tenant_of(k.entry) for k in config.named_keys]
    return [DEFAULT, *named] if config.api_keys or not named else named


def key_checker(config: Config) -> KeyChecker[Tenant]:
    """The keys in force, each with its tenant; without any, every request is `default`."""
    keys = [(k.get_secret_value(), DEFAULT) for k in config.api_keys]
    keys += [(k.secret.get_secret_value(), tenant_of(k.entry)) for k in config.named_keys]
    return KeyChecker(keys, anonymous=DEFAULT)


def identified(request: web.Request, tenant: Tenant) -> None:
    """The auth middleware found the request's key: the handler reads the tenant from the
    request, the access line its name."""
    request[TENANT] = tenant
    ex = request.get(EXCHANGE)
    if ex is not None:
        ex.key = tenant.name
    if not tenant.admin and request.path.startswith(ADMIN_PATHS):
        raise errors.AdminOnly(
            f"the key {tenant.name!r} may not read /admin: the unnamed keys may, and a "
            'named key with "admin": true'
        )
