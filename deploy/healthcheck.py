"""The image's HEALTHCHECK: GET /healthz where the running gateway serves it; exit 0 or 1.

The port is read from the config at run time, not written into the Dockerfile: the admin
listener's (`[gateway] admin_port`, on `admin_host`) when the file sets one, else the main
listener's (`port` on `host`), so a config that moves a port moves the check with it.
An address that listens on every interface (0.0.0.0, ::) is asked on loopback.

GATEWAY_CONFIG names the file (default: the image's CMD's, /etc/gateway/config.toml);
GATEWAY_HEALTHCHECK_URL, when set, is asked instead (for a CMD that overrides the port
with --port). Python's standard library only: the slim image has no curl.
"""

from __future__ import annotations

import os
import sys
import tomllib
import urllib.request
from typing import Any

CONFIG = "/etc/gateway/config.toml"
DEFAULT_HOST = "127.0.0.1"  # [gateway] host's default
DEFAULT_PORT = 8080  # [gateway] port's default


def url(config: dict[str, Any]) -> str:
    """The /healthz URL of the listener that serves it under `config` (parsed TOML)."""
    gateway = config.get("gateway", {})
    host = gateway.get("host", DEFAULT_HOST)
    port = gateway.get("port", DEFAULT_PORT)
    if gateway.get("admin_port") is not None:
        host = gateway.get("admin_host", host)
        port = gateway["admin_port"]
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{int(port)}/healthz"


def main() -> int:
    try:
        target = os.environ.get("GATEWAY_HEALTHCHECK_URL")
        if not target:
            with open(os.environ.get("GATEWAY_CONFIG", CONFIG), "rb") as file:
                target = url(tomllib.load(file))
        with urllib.request.urlopen(target, timeout=2) as answer:
            return 0 if answer.status == 200 else 1
    except Exception as error:  # any failure is "unhealthy", said in `docker inspect`
        print(f"healthcheck: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
