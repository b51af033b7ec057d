"""What the deploy tests share: deploy/kubernetes rendered as `kubectl apply -k` sees it, and
the files of its ConfigMap.

`render()` follows kustomization.yaml's `resources` (files and folders) the way kustomize
does for a kustomization that uses nothing else; `kustomization_keys()` lets a test insist
that it uses nothing else, so this rendering stays the real one (and a test compares it
with `kubectl kustomize` where kubectl is installed).
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

import yaml

from gateway.config.schema import GatewaySection

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
DEPLOYMENT = ROOT / "docs" / "deployment.md"

# The [gateway] keys of issue 33 the ConfigMap sets, which the gateway's loader may not
# know yet (its code is written in parallel); tests that start or load the gateway use a
# copy of the file without the ones it does not know (see `loader_compatible`).
NEW_GATEWAY_KEYS = ("admin_host", "admin_port", "trusted_proxies")


def _yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]


def kustomizations(folder: Path = K8S) -> list[tuple[Path, dict[str, Any]]]:
    """Every kustomization.yaml reached from `folder`'s, with its own folder."""
    (kustomization,) = _yaml_docs(folder / "kustomization.yaml")
    found = [(folder, kustomization)]
    for entry in kustomization.get("resources", []):
        if (folder / entry).is_dir():
            found += kustomizations(folder / entry)
    return found


def render(folder: Path = K8S) -> list[dict[str, Any]]:
    """The objects `kubectl apply -k folder` creates, in the order the files list them."""
    (kustomization,) = _yaml_docs(folder / "kustomization.yaml")
    docs: list[dict[str, Any]] = []
    for entry in kustomization.get("resources", []):
        path = folder / entry
        docs += render(path) if path.is_dir() else _yaml_docs(path)
    return docs


def objects(kind: str, docs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    return [d for d in (render() if docs is None else docs) if d["kind"] == kind]


def named(kind: str, name: str, docs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    (doc,) = [d for d in objects(kind, docs) if d["metadata"]["name"] == name]
    return doc


def gateway_deployment() -> dict[str, Any]:
    return named("Deployment", "vllm-gateway")


def gateway_container() -> dict[str, Any]:
    (container,) = gateway_deployment()["spec"]["template"]["spec"]["containers"]
    return dict(container)


def container_ports(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def configmap_file(name: str) -> str:
    text: str = named("ConfigMap", "vllm-gateway")["data"][name]
    return text


def config_toml() -> dict[str, Any]:
    """The ConfigMap's config.toml as TOML (before `${VAR}` expansion)."""
    return tomllib.loads(configmap_file("config.toml"))


def loader_knows(key: str) -> bool:
    """Whether this gateway's loader accepts `[gateway] <key>`."""
    return key in GatewaySection.model_fields


def loader_compatible(text: str, drop: tuple[str, ...] = ()) -> str:
    """config.toml without the NEW_GATEWAY_KEYS this loader does not know, and without
    those in `drop` whether it knows them or not. Each such key sits on a line of its own."""
    gone = [k for k in NEW_GATEWAY_KEYS if k in drop or not loader_knows(k)]
    if not gone:
        return text
    line = re.compile(rf"^\s*({'|'.join(gone)})\s*=.*\n?", re.MULTILINE)
    out = line.sub("", text)
    assert not set(gone) & set(tomllib.loads(out).get("gateway", {})), "a key spans lines"
    return out


def deployment_guide() -> str:
    """docs/deployment.md: running in production (the image, Kubernetes, systemd)."""
    return DEPLOYMENT.read_text(encoding="utf-8")


def dockerfile_instructions() -> list[tuple[str, str]]:
    """deploy/Dockerfile as (INSTRUCTION, rest) pairs, continuation lines joined."""
    text = (DEPLOY / "Dockerfile").read_text(encoding="utf-8").replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), " ".join(rest.split())))
    return out


def dockerfile_cmd() -> list[str]:
    (cmd,) = [rest for word, rest in dockerfile_instructions() if word == "CMD"]
    argv = json.loads(cmd)  # exec form: the gateway is PID 1 and gets the signals itself
    assert isinstance(argv, list)
    return [str(a) for a in argv]
