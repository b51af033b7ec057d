"""The dashboard and the alert rules in deploy/, checked by promtool and run by a real Prometheus.

promtool checks the rule file and the example config, and runs the alert unit tests
(tests/prometheus/alerts_test.yml). Then Debian's `prometheus` binary scrapes a gateway on
loopback every second while traffic of each kind goes through it, and every PromQL
expression of the dashboard and of the alert rules is evaluated through its HTTP API: each
must return data.

An alert expression returns nothing while its condition is false, which would say nothing
about whether it reads series that exist. So the test evaluates each one with its
comparisons made `bool` (`gateway_instance_up == 0` becomes `gateway_instance_up == bool
0`): the same expression, returning 0 or 1 for every series it watches instead of only the
ones over the threshold. An expression that names a metric or label the gateway does not
export stays empty and fails. An `absent(x)` alert is checked the other way round: `x`
returns data, and the rule as written none.

The one series that appears only with a failure, gateway_shared_state_errors_total, is made
to appear by a malformed peer entry written into Redis, which the gateway refuses each round.

Skipped with a clear message on a developer's machine without the binaries; in CI (env
CI set, .ci/run installs Debian's prometheus) a missing binary fails the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
import yaml
from fakes import KEY, Gateway, fleet, gateway_with
from redis_server import free_port, redis_server

from gateway.server.resources import SHARED
from gateway.sim.sim_vllm import SimConfig

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "gateway-dashboard.json"
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"
EXAMPLE_CONFIG = REPO / "deploy" / "prometheus" / "prometheus.yml"
ALERT_TESTS = REPO / "tests" / "prometheus" / "alerts_test.yml"
# The job the example config scrapes the gateway as, which GatewayTargetDown selects on.
(GATEWAY_JOB,) = [
    c["job_name"] for c in yaml.safe_load(EXAMPLE_CONFIG.read_text())["scrape_configs"]
]

AUTH = {"Authorization": f"Bearer {KEY}"}
# Grafana's variables, as the test fills them in: every job, process and server, and a range
# that covers the whole test (Prometheus scrapes from the start of it), so rates see all its
# traffic.
GRAFANA_VARIABLES = {
    "${job}": ".*",
    "$job": ".*",
    "${instance}": ".*",
    "$instance": ".*",
    "${server}": ".*",
    "$server": ".*",
    "$__rate_interval": "1m",
    "$__interval": "1m",
    "$__range": "1m",
}
# 2 slots on each of 2 instances, none waiting at them, 4 places in the gateway queue: of a
# burst of 10 streams 4 run, 4 wait in the queue (its wait panel) and 2 are refused.
SIM = SimConfig(max_num_seqs=2, decode_s_per_token=0.005, prefill_tokens_per_s=1e6)
SECTIONS: dict[str, dict[str, Any]] = {
    # A scrape is trusted for 3 health rounds; at the helpers' 0.2 s a round slowed by a busy
    # CI machine let the KV gauge go unknown (NaN) between Prometheus scrapes.
    "dispatch": {
        "max_num_seqs": 2,
        "max_queue_per_instance": 0,
        "gateway_queue_size": 4,
        "health_check_interval": 1.0,
    },
    "prefill": {"long_input_threshold": 100},
}


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is missing: .ci/run installs Debian's prometheus package")
        pytest.skip(f"{name} is not installed (apt-get install prometheus)")
    return path


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [binary("promtool"), *args], capture_output=True, text=True, timeout=60, check=False
    )


def load_rules() -> list[dict[str, Any]]:
    """Every alert rule of deploy/prometheus/alerts.yml, each with its group's name."""
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [{**rule, "group": group["name"]} for group in groups for rule in group["rules"]]


def dashboard_targets() -> list[tuple[str, str]]:
    """(panel title, expr) of every query of the dashboard, however deep its panel sits."""
    found: list[tuple[str, str]] = []

    def walk(node: Any, title: str) -> None:
        if isinstance(node, dict):
            title = node.get("title", title) if "targets" in node else title
            if "expr" in node:
                found.append((title, node["expr"]))
            for value in node.values():
                walk(value, title)
        elif isinstance(node, list):
            for value in node:
                walk(value, title)

    walk(json.loads(DASHBOARD.read_text())["panels"], "")
    return found


def fill_variables(expr: str) -> str:
    """The expression as Grafana would send it, the test's values standing in for variables."""
    for name in sorted(GRAFANA_VARIABLES, key=len, reverse=True):
        expr = expr.replace(name, GRAFANA_VARIABLES[name])
    assert "$" not in expr, f"a Grafana variable the test does not fill in: {expr}"
    return expr


_COMPARISON = re.compile(r"(==|!=|>=|<=|>|<)(?!\s*bool\b)")


def comparisons_as_bool(expr: str) -> str:
    """Each comparison outside label matchers (`{...}`, where `=`/`!=` are not comparisons)
    gets the `bool` modifier, so the expression keeps every series it compares."""
    parts = re.split(r"(\{[^}]*\})", expr)
    return "".join(p if p.startswith("{") else _COMPARISON.sub(r"\1 bool", p) for p in parts)


_ABSENT = re.compile(r"absent\((.+)\)")


def watched_series(expr: str) -> str:
    """What an alert expression watches, made to return every series it looks at:
    `absent(x)` watches `x` (and returns data only when `x` has none); any other
    expression with its comparisons made `bool`."""
    absent = _ABSENT.fullmatch(expr.strip())
    return absent.group(1) if absent else comparisons_as_bool(expr)


def test_watched_series_of_an_absent_alert_is_its_selector() -> None:
    """absent(up{job="gateway"}) watches up{job="gateway"}; a threshold watches with bool."""
    assert watched_series('absent(up{job="gateway"})') == 'up{job="gateway"}'
    assert watched_series('x{a="b"} > 1') == 'x{a="b"} > bool 1'


def test_comparisons_as_bool_leaves_label_matchers_alone() -> None:
    """The rewrite adds `bool` to comparisons only, not to `=`, `!=` or `=~` in matchers."""
    expr = 'rate(x{a!="b", c=~"d"}[5m]) < 0.9 and y{e="f"} > 0.05 or z == bool 1'
    assert comparisons_as_bool(expr) == (
        'rate(x{a!="b", c=~"d"}[5m]) < bool 0.9 and y{e="f"} > bool 0.05 or z == bool 1'
    )


def test_promtool_accepts_the_rules_and_the_example_config() -> None:
    """`promtool check rules` and `check config` pass on deploy/prometheus."""
    rules = promtool("check", "rules", str(ALERTS))
    assert rules.returncode == 0, rules.stdout + rules.stderr
    config = promtool("check", "config", str(EXAMPLE_CONFIG))
    assert config.returncode == 0, config.stdout + config.stderr
    # The example loads the rules it ships beside.
    assert "alerts.yml" in yaml.safe_load(EXAMPLE_CONFIG.read_text())["rule_files"]


def test_alert_unit_tests_fire_and_spare_every_alert() -> None:
    """`promtool test rules` passes, and it checks each alert both firing and not firing."""
    names = {rule["alert"] for rule in load_rules()}
    cases = [
        case
        for test in yaml.safe_load(ALERT_TESTS.read_text())["tests"]
        for case in test["alert_rule_test"]
    ]
    fired = {case["alertname"] for case in cases if case.get("exp_alerts")}
    silent = {case["alertname"] for case in cases if not case.get("exp_alerts")}
    assert names - fired == set(), "alerts no unit test fires"
    assert names - silent == set(), "alerts no unit test checks silent"
    for rule in load_rules():
        assert rule.get("for"), f"{rule['alert']} has no for:"
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert {"summary", "description"} <= set(rule["annotations"]), rule["alert"]
    result = promtool("test", "rules", str(ALERT_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr


@dataclass
class Prometheus:
    url: str
    session: aiohttp.ClientSession

    async def get(self, path: str, **params: str) -> Any:
        async with self.session.get(self.url + path, params=params) as resp:
            body = await resp.json()
            assert resp.status == 200, (path, params, body)
            assert body["status"] == "success", (path, params, body)
            return body["data"]

    async def query(self, expr: str) -> list[dict[str, Any]]:
        data = await self.get("/api/v1/query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        result: list[dict[str, Any]] = data["result"]
        return result

    async def value(self, expr: str) -> float:
        """The value of an expression that returns one series, NaN if it returns none."""
        result = await self.query(expr)
        return float(result[0]["value"][1]) if result else math.nan


@contextlib.asynccontextmanager
async def prometheus_scraping(gw: Gateway, folder: Path) -> AsyncIterator[Prometheus]:
    """A real Prometheus on loopback scraping the gateway every second, with the alert rules."""
    executable = binary("prometheus")
    port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ALERTS)],
        "scrape_configs": [
            {
                "job_name": GATEWAY_JOB,
                "scrape_interval": "1s",
                "static_configs": [{"targets": [gw.url.removeprefix("http://")]}],
            }
        ],
    }
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = (folder / "prometheus.log").open("wb")
    proc = await asyncio.create_subprocess_exec(
        executable,
        f"--config.file={folder / 'prometheus.yml'}",
        f"--storage.tsdb.path={folder / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        async with aiohttp.ClientSession() as session:
            prom = Prometheus(f"http://127.0.0.1:{port}", session)
            await wait_for(lambda: ready(prom), "Prometheus to be ready", folder)
            yield prom
    finally:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), timeout=10)
        except TimeoutError:
            proc.kill()
            await proc.wait()
        log.close()


async def ready(prom: Prometheus) -> bool:
    with contextlib.suppress(aiohttp.ClientError):
        async with prom.session.get(prom.url + "/-/ready") as resp:
            return resp.status == 200
    return False


async def wait_for(check: Any, what: str, folder: Path | None = None, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            log = (folder / "prometheus.log").read_text() if folder else ""
            raise AssertionError(f"timed out waiting for {what}\n{log}")
        await asyncio.sleep(0.2)


async def stream_chat(session: aiohttp.ClientSession, gw: Gateway, content: str) -> int:
    body = {"messages": [{"role": "user", "content": content}], "stream": True, "max_tokens": 8}
    async with session.post(gw.url + "/v1/chat/completions", json=body, headers=AUTH) as resp:
        await resp.read()
        return resp.status


async def drive_traffic(gw: Gateway) -> None:
    """Streams of both lanes, a whole answer, a 401, a 404 and a burst that is partly refused."""
    async with aiohttp.ClientSession() as session:
        for _ in range(4):
            assert await stream_chat(session, gw, "hello") == 200
        for _ in range(2):
            assert await stream_chat(session, gw, "word " * 300) == 200  # the prefill lane
        whole = {"prompt": "hi", "max_tokens": 4}
        async with session.post(gw.url + "/v1/completions", json=whole, headers=AUTH) as resp:
            assert resp.status == 200
        wrong_key = {"Authorization": "Bearer sk-wrong"}
        async with session.post(gw.url + "/v1/completions", json=whole, headers=wrong_key) as r:
            assert r.status == 401
        async with session.get(gw.url + "/v1/no-such-route", headers=AUTH) as resp:
            assert resp.status == 404
        burst = await asyncio.gather(*(stream_chat(session, gw, "hello") for _ in range(10)))
        assert 429 in burst, burst
        assert 200 in burst, burst


async def refuse_a_peer(gw: Gateway, redis_url: str) -> None:
    """A malformed entry listed as a peer in Redis: every round refuses it and counts it in
    gateway_shared_state_errors_total{reason="malformed"}, which exists only after a failure,
    while the view stays shared (GatewaySharedStateErrors' case)."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        await client.set("gateway:process:broken", b"{not json")
        await client.sadd("gateway:processes", "broken")
    finally:
        await client.aclose()

    async def refused() -> bool:
        return gw.app[SHARED].errors.get("malformed", 0) > 0

    await wait_for(refused, "the broken peer to be refused")


async def test_every_dashboard_and_alert_expression_returns_data_from_prometheus(
    tmp_path: Path,
) -> None:
    """A real Prometheus scraping a gateway under traffic returns data for every PromQL
    expression of the dashboard and of the alert rules, and has loaded every rule group."""
    binary("prometheus")  # named first when both binaries are missing
    with redis_server() as redis:
        sections = {**SECTIONS, "shared": {"redis_url": redis.url, "publish_interval": 0.05}}
        async with (
            fleet(SIM, SIM) as sims,
            gateway_with(sims, sections=sections) as gw,
            prometheus_scraping(gw, tmp_path) as prom,
        ):
            await refuse_a_peer(gw, redis.url)
            await scrape_traffic_and_evaluate(gw, prom, tmp_path)


async def scrape_traffic_and_evaluate(gw: Gateway, prom: Prometheus, folder: Path) -> None:
    targets = dashboard_targets()
    rules = load_rules()
    assert len(targets) >= 20

    async def scraped(after: float) -> bool:
        return await prom.value("max(timestamp(gateway_build_info))") > after

    # The first scrape comes before any traffic, so rates see all of it.
    await wait_for(lambda: scraped(0), "the first scrape", folder)
    await drive_traffic(gw)
    # Two more scrapes after the last request, so the last counts are in.
    done = time.time()
    await wait_for(lambda: scraped(done + 1), "scrapes after the traffic", folder)

    results: dict[str, list[dict[str, Any]]] = {}
    for title, expr in targets:
        results[expr] = await prom.query(fill_variables(expr))
        assert results[expr], f"dashboard panel {title!r} has no data: {expr}"
    for rule in rules:
        watched = watched_series(rule["expr"])
        assert watched != rule["expr"], rule["expr"]
        assert await prom.query(watched), f"alert {rule['alert']} watches nothing: {watched}"
        written = await prom.query(rule["expr"])  # the rule as written evaluates too
        if rule["expr"].startswith("absent("):
            assert written == [], f"{rule['alert']}: the gateway is scraped, yet {written}"

    async def rules_evaluated() -> bool:
        data = await prom.get("/api/v1/rules")
        loaded = [r for g in data["groups"] for r in g["rules"]]
        return len(loaded) == len(rules) and all(r["health"] == "ok" for r in loaded)

    await wait_for(rules_evaluated, "every rule to be evaluated", folder)
    data = await prom.get("/api/v1/rules")
    assert {g["name"] for g in data["groups"]} == {r["group"] for r in rules}
    assert {r["name"] for g in data["groups"] for r in g["rules"]} == {r["alert"] for r in rules}
    # The dashboard's variables: label_values(gateway_build_info, job), then instance, then
    # label_values(gateway_instance_up{...}, server).
    jobs = await prom.get("/api/v1/label/job/values", **{"match[]": "gateway_build_info"})
    assert jobs == [GATEWAY_JOB]
    processes = await prom.get("/api/v1/label/instance/values", **{"match[]": "gateway_build_info"})
    assert processes == [gw.url.removeprefix("http://")]
    servers = await prom.get("/api/v1/label/server/values", **{"match[]": "gateway_instance_up"})
    assert sorted(servers) == sorted(gw.names())

    # What the panels show is the traffic that went through.
    def panel(title: str, has: str = "") -> dict[str, list[dict[str, Any]]]:
        """The results of the panel's queries (those whose expression holds `has`)."""
        found = {e: results[e] for t, e in targets if t == title and has in e}
        assert found, (title, has)
        return found

    def by(label: str, title: str, has: str = "", **match: str) -> dict[str, float]:
        """The panel's values by `label`, of the series whose labels have `match`; two
        series with one value of `label` (a panel by lane and class) are an error, not a
        draw of whichever Prometheus listed last."""
        ((_, result),) = panel(title, has).items()
        chosen = [r for r in result if all(r["metric"].get(k) == v for k, v in match.items())]
        values = {r["metric"][label]: float(r["value"][1]) for r in chosen}
        assert len(values) == len(chosen), (title, label, chosen)
        return values

    statuses = by("status", "Request rate by status")
    for status in ("200", "401", "404", "429"):
        assert statuses.get(status, 0) > 0, (status, statuses)
    ttft_by_lane = by("lane", "TTFT p50 / p99 per lane", "0.99")
    assert set(ttft_by_lane) == {"short", "prefill"}
    assert all(0 < v <= 2 for v in ttft_by_lane.values()), ttft_by_lane
    assert by("lane", "Goodput share per lane")["short"] > 0.5
    refused = by("reason", "Rejections by reason")
    assert sum(refused.values()) > 0, refused
    # Request duration and queue wait: both lanes reached an instance; the burst queued.
    durations = by("lane", "Request duration p50 / p99 per lane", "0.99")
    assert set(durations) == {"short", "prefill"}
    assert all(0 < v <= 5 for v in durations.values()), durations
    waits = by("lane", "Queue wait p50 / p99 per lane", "0.99", priority="interactive")
    assert 0 < waits["short"] <= 2
    kv_cache = by("server", "KV cache use per server")
    assert sorted(kv_cache) == sorted(gw.names())
    assert all(0 <= v <= 1 for v in kv_cache.values()), kv_cache
    slots = by("server", "Running slots per server")
    assert slots == dict.fromkeys(gw.names(), 2.0)
    # One process, one configuration: its digest, a count of 1, and no failed reload.
    ((_, digests),) = panel("Configuration digest per process").items()
    assert [r["metric"]["hash"] for r in digests] == [gw.config.digest()]
    assert by("job", "Configurations and reloads", "count by (job)") == {GATEWAY_JOB: 1}
    last_reload = by("instance", "Configurations and reloads", "last_reload_successful")
    assert list(last_reload.values()) == [1]
    # Keys: the unnamed key's tokens of both kinds, its requests served and those the
    # burst had refused (429s of the gateway's own, not errors).
    tokens = by("kind", "Tokens by key", key="default")
    assert tokens["prompt"] > 0, tokens
    assert tokens["completion"] > 0, tokens
    outcomes = by("outcome", "Requests by key and outcome", key="default")
    assert outcomes["ok"] > 0, outcomes
    assert outcomes["refused"] > 0, outcomes
    assert outcomes["error"] == 0, outcomes
    # Capacity and cache: the model's saturation (idle by now), each server's metrics read
    # within the last health rounds, its prefix-cache rate, no fallback (no prefill role).
    saturation = by("model", "Fleet saturation by model")
    assert list(saturation) == ["sim-model"]
    assert 0 <= saturation["sim-model"] < 1
    ages = by("server", "Metrics scrape age per server")
    assert sorted(ages) == sorted(gw.names())
    assert all(0 <= age < 5 for age in ages.values()), ages
    assert sorted(by("server", "Prefix-cache hit rate per server", "vllm")) == sorted(gw.names())
    fallbacks = by("reason", "Prefill fallbacks by reason", "fallbacks")
    assert fallbacks == dict.fromkeys(("prefill_failed", "unplaced", "no_params"), 0.0)
    errors = by("reason", "Shared state errors by reason")
    assert errors.get("malformed", 0) > 0, errors
    # The broken peer holds GatewaySharedStateErrors' condition (pending, `for:` to go).
    (rule,) = [r for r in rules if r["alert"] == "GatewaySharedStateErrors"]
    assert [r["metric"]["reason"] for r in await prom.query(rule["expr"])] == ["malformed"]
    assert await prom.value("sum(max by (server) (gateway_instance_up))") == 2
    assert await prom.value("min by (instance) (gateway_shared_state_up)") == 1
