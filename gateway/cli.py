"""`gateway`: validate the configuration, then serve (optionally before simulated vLLM).

    gateway [--config config.toml] [--settings settings.json] [--check] [--simulate]
            [--host H] [--port P] [--workers N] [--open] [--log-level info]
            [--log-format json|console] [--version]

Without --config it uses the defaults embedded in the package (two instances on
127.0.0.1:8000-8001, key from GATEWAY_API_KEY), which suit --simulate.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from gateway import __version__
from gateway.config import preflight
from gateway.config.load import Config, ConfigError, load
from gateway.observe import log

_EPILOG = """\
environment:
  GATEWAY_API_KEY   the gateway's key (comma-separated keys for rotation); the variable
                    is named by [gateway] api_key_env (default GATEWAY_API_KEY) and
                    channel.api_key_env in settings.json; channel.api_key may hold keys too
  ${VAR}            expanded from the environment in every string of config.toml and
                    settings.json; an unset VAR is a configuration error
  ${VAR:-default}   the default when VAR is unset or empty
  an instance's api_key_env names the variable with the key sent to that instance

signals:
  SIGHUP            reload config.toml and settings.json (a bad file keeps the old ones)
  SIGTERM, SIGINT   drain: /readyz 503 for drain_delay s, then close the listener and give
                    requests drain_timeout s; a second signal ends the drain at once

exit status: 0 ok, 1 cannot listen, 2 configuration error
"""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows each flag's default, except where there is none to show (the help says why)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gateway",
        description="OpenAI-compatible dispatch gateway for vLLM fleets",
        epilog=_EPILOG,
        formatter_class=_HelpFormatter,
    )
    p.add_argument(
        "--config",
        metavar="PATH",
        help="config.toml (default: the built-in one: two instances on 127.0.0.1:8000-8001)",
    )
    p.add_argument(
        "--settings", metavar="PATH", help="settings.json (default: beside the config file)"
    )
    p.add_argument(
        "--check", action="store_true", help="validate the configuration and exit (default: off)"
    )
    p.add_argument(
        "--simulate",
        action="store_true",
        help="start a simulated vLLM instance on each configured (loopback) URL first "
        "(default: off)",
    )
    p.add_argument(
        "--host", help="listen address (default: [gateway] host, itself 127.0.0.1 by default)"
    )
    p.add_argument(
        "--port", type=int, help="listen port (default: [gateway] port, itself 8080 by default)"
    )
    p.add_argument(
        "--open", action="store_true", help="run without an API key, no auth (default: off)"
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="least severe log events written (default: %(default)s; debug adds the access "
        "lines of successful probes and scrapes)",
    )
    p.add_argument(
        "--log-format",
        choices=["json", "console"],
        help="json: one JSON object a line; console: readable lines (default: console on a "
        "terminal, json otherwise; json forces it under e.g. `docker run -t`)",
    )
    p.add_argument(
        "--workers",
        type=int,
        help="processes serving the port (default: [gateway] workers, itself 1; see "
        "Workers in docs/operations.md)",
    )
    p.add_argument("--version", action="version", version=f"gateway {__version__}")
    return p


def _config_path(given: str | None) -> Path:
    if given:
        return Path(given)
    return Path(str(resources.files("gateway") / "defaults" / "config.toml"))


def load_config(args: argparse.Namespace) -> Config:
    config = load(_config_path(args.config), args.settings, allow_no_key=args.open)
    return config.with_listen(args.host, args.port).with_workers(args.workers)


def run_preflight(config: Config, args: argparse.Namespace) -> list[str]:
    """The checks that need this machine; a taken port only warns, and only with --check."""
    in_file = f"{config.config_path}: [gateway]"
    port_from = "--port" if args.port is not None else f"{in_file} port"
    return preflight.check(
        config,
        host_from="--host" if args.host is not None else f"{in_file} host",
        port_from=port_from if args.check else None,
    )


def listen_report(config: Config) -> str:
    """What `--check` found of the addresses serving would listen on: it listens on none,
    it only tries to bind each one and lets go at once."""
    gateway = config.gateway
    addresses = [("", gateway.host, gateway.port)]
    if gateway.admin_port is not None:
        addresses.append(("admin ", gateway.admin_host or gateway.host, gateway.admin_port))
    shown = []
    for role, host, port in addresses:
        if port == 0:
            state = "any free port"
        elif preflight.bind_problem(host, port):
            state = "cannot be bound now"
        else:
            state = "free now"
        shown.append(f"{role}{host}:{port} ({state})")
    workers = f" with {gateway.workers} workers" if gateway.workers > 1 else ""
    return f"would listen on {' and '.join(shown)}{workers}; nothing was started"


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config = load_config(args)
        warnings = run_preflight(config, args)
    except ConfigError as exc:
        print(f"gateway: configuration error: {exc}", file=sys.stderr)
        return 2
    if args.check:
        for warning in warnings:
            print(f"gateway: warning: {warning}", file=sys.stderr)
        print(
            f"ok: {config.config_path} and {config.settings_path} are valid; "
            f"{len(config.instances)} instance(s), strategy {config.dispatch.strategy}, "
            f"{len(config.api_keys) + len(config.named_keys)} key(s); {listen_report(config)}"
        )
        return 0
    log.configure(
        args.log_level, json=None if args.log_format is None else args.log_format == "json"
    )
    for warning in warnings:
        log.get("gateway.cli").warning("config_warning", problem=warning)
    if config.gateway.workers > 1:
        from gateway.process.workers import supervise

        return supervise(config, args.log_level, simulate=args.simulate)
    from gateway.process.serve import serve_here

    return serve_here(config, simulate=args.simulate)


if __name__ == "__main__":
    sys.exit(main())
