"""What an operator reads: every request counted and logged, series at zero from the start,
and Prometheus' naming conventions."""

from __future__ import annotations

import platform
from typing import Any

import aiohttp
import structlog
from fakes import KEY, Gateway, fleet, gateway_with
from prometheus_client.parser import text_string_to_metric_families

from gateway import __version__
from gateway.sim.sim_vllm import SimConfig

AUTH = {"Authorization": f"Bearer {KEY}"}
BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape_text(gw: Gateway) -> str:
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as resp:
        return await resp.text()


async def scrape(gw: Gateway) -> Samples:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(await scrape_text(gw))
        for sample in family.samples
    }


def series(samples: Samples, name: str, **labels: str) -> float | None:
    """The value of the one series with exactly these labels, None if it does not exist."""
    return samples.get((name, frozenset(labels.items())))


def access_lines(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == "request"]


async def test_labelled_series_exist_at_zero_before_any_request() -> None:
    """Before the first request, /metrics already shows the known label sets at 0."""
    async with (
        fleet(SimConfig(instant=True), SimConfig(instant=True)) as sims,
        gateway_with(sims) as gw,
    ):
        samples = await scrape(gw)
        servers = gw.names()
    for lane in ("short", "prefill"):
        for priority in ("interactive", "batch"):
            waits = "gateway_queue_wait_seconds_count"
            assert series(samples, waits, lane=lane, priority=priority) == 0
    assert series(samples, "gateway_request_duration_seconds_count", lane="prefill") == 0
    for server in servers:
        assert series(samples, "gateway_instance_requests_total", server=server, status="200") == 0
        assert series(samples, "gateway_instance_requests_total", server=server, status="503") == 0
        for kind in ("connect", "timeout", "bad_response"):
            assert series(samples, "gateway_instance_errors_total", server=server, kind=kind) == 0
        for lane in ("short", "prefill"):
            assert series(samples, "gateway_ttft_seconds_count", lane=lane, server=server) == 0
            assert series(samples, "gateway_tpot_seconds_count", lane=lane, server=server) == 0
            for priority in ("interactive", "batch"):
                at = {"lane": lane, "server": server, "priority": priority}
                assert series(samples, "gateway_goodput_requests_total", **at) == 0
                for objective in ("ttft", "tpot"):
                    for result in ("met", "missed"):
                        labels = {"objective": objective, "result": result}
                        name = "gateway_slo_requests_total"
                        assert series(samples, name, **at, **labels) == 0
    for reason in ("queue_full", "predicted_wait", "no_instance", "deadline", "shutting_down"):
        assert series(samples, "gateway_rejections_total", reason=reason) == 0
    for reason in ("connect", "timeout", "bad_response", "status_429", "status_503"):
        assert series(samples, "gateway_retries_total", reason=reason) == 0
    for why in ("attempts", "deadline", "budget", "instances"):
        assert series(samples, "gateway_retries_refused_total", why=why) == 0
    for side in ("client", "upstream", "shutdown"):
        assert series(samples, "gateway_stream_aborts_total", side=side) == 0
    requests = "gateway_requests_total"
    unplaced = {"lane": "none", "model": "none", "tag": "none"}
    assert series(samples, requests, route="chat.completions", status="401", **unplaced) == 0
    assert series(samples, requests, route="admin.instances", status="401", **unplaced) == 0
    assert series(samples, requests, route="other", status="404", **unplaced) == 0
    for status in ("200", "429", "502", "503", "504"):
        for lane in ("short", "prefill"):
            placed = {"lane": lane, "model": "sim-model", "tag": "none"}
            assert series(samples, requests, route="completions", status=status, **placed) == 0


async def test_unauthenticated_unknown_and_wrong_method_requests_are_counted_and_logged() -> None:
    """A 401, a 404 on an unknown path and a 405 each count once and get an access-log line."""
    async with (
        fleet(SimConfig(instant=True)) as sims,
        gateway_with(sims) as gw,
        aiohttp.ClientSession() as session,
    ):
        with structlog.testing.capture_logs() as events:
            wrong = {"Authorization": "Bearer sk-guessed-key", "User-Agent": "guesser/1"}
            async with session.post(gw.url + "/v1/chat/completions", json=BODY, headers=wrong) as r:
                assert r.status == 401
                unauthorized_id = r.headers["X-Request-ID"]
            async with session.get(gw.url + "/wp-login.php?user=admin", headers=AUTH) as r:
                assert r.status == 404
            async with session.put(gw.url + "/v1/completions", headers=AUTH) as r:
                assert r.status == 405
        samples = await scrape(gw)
    unplaced = {"lane": "none", "model": "none", "tag": "none"}
    name = "gateway_requests_total"
    assert series(samples, name, route="chat.completions", status="401", **unplaced) == 1
    assert series(samples, name, route="other", status="404", **unplaced) == 1
    assert series(samples, name, route="completions", status="405", **unplaced) == 1
    unauthorized, unknown, wrong_method = access_lines(events)
    assert unauthorized["status"] == 401
    assert unauthorized["route"] == "chat.completions"
    assert unauthorized["method"] == "POST"
    assert unauthorized["path"] == "/v1/chat/completions"
    assert unauthorized["client"] == "127.0.0.1"
    assert unauthorized["user_agent"] == "guesser/1"
    assert unauthorized["request_id"] == unauthorized_id
    assert unauthorized["log_level"] == "info"
    assert (unknown["status"], unknown["route"], unknown["path"]) == (404, "other", "/wp-login.php")
    assert (wrong_method["status"], wrong_method["route"]) == (405, "completions")
    assert "sk-guessed-key" not in repr(events)
    assert KEY not in repr(events)


async def test_expect_refusals_are_counted_and_logged() -> None:
    """A request refused at `Expect: 100-continue` (no middleware runs) is still recorded."""
    async with (
        fleet(SimConfig(instant=True)) as sims,
        gateway_with(sims) as gw,
        aiohttp.ClientSession() as session,
    ):
        with structlog.testing.capture_logs() as events:
            async with session.post(
                gw.url + "/v1/chat/completions", json=BODY, expect100=True
            ) as r:
                assert r.status == 401
        samples = await scrape(gw)
    unplaced = {"lane": "none", "model": "none", "tag": "none"}
    name = "gateway_requests_total"
    assert series(samples, name, route="chat.completions", status="401", **unplaced) == 1
    (line,) = access_lines(events)
    assert (line["status"], line["route"]) == (401, "chat.completions")
    assert line["request_id"]


async def test_access_log_line_of_a_streamed_request_has_every_field() -> None:
    """A served stream's access-log line names client, model, tokens, server, timings and tag."""
    async with (
        fleet(SimConfig(decode_s_per_token=0.001)) as sims,
        gateway_with(sims) as gw,
        aiohttp.ClientSession() as session,
    ):
        headers = {**AUTH, "X-Request-Tag": "team-a", "User-Agent": "x" * 500}
        body = {**BODY, "stream": True}
        with structlog.testing.capture_logs() as events:
            async with session.post(
                gw.url + "/v1/chat/completions", json=body, headers=headers
            ) as r:
                assert r.status == 200
                streamed = await r.read()
        samples = await scrape(gw)
        (server,) = gw.names()
    (line,) = access_lines(events)
    assert line["client"] == "127.0.0.1"
    assert (line["method"], line["path"]) == ("POST", "/v1/chat/completions")
    assert (line["route"], line["status"], line["model"]) == ("chat.completions", 200, "sim-model")
    assert line["prompt_tokens"] > 0
    assert line["completion_tokens"] == 4
    assert line["bytes_sent"] >= len(streamed)
    assert (line["server"], line["attempts"]) == (server, 1)
    assert line["queue_wait_ms"] >= 0
    assert 0 < line["ttft_ms"] <= line["duration_ms"]
    assert line["user_agent"] == "x" * 200
    assert len(line["request_id"]) == 32
    assert (line["tag"], line["lane"]) == ("team-a", "short")
    assert "instance" not in line
    assert KEY not in repr(events)
    assert series(samples, "gateway_ttft_seconds_count", lane="short", server=server) == 1
    assert series(samples, "gateway_tpot_seconds_count", lane="short", server=server) == 1


async def test_metrics_follow_prometheus_conventions() -> None:
    """No instance/job labels, no _created series, process_ metrics and gateway_build_info."""
    async with (
        fleet(SimConfig(instant=True)) as sims,
        gateway_with(sims) as gw,
        aiohttp.ClientSession() as session,
    ):
        async with session.post(gw.url + "/v1/completions", json={"prompt": "x"}, headers=AUTH):
            pass
        text = await scrape_text(gw)
        (server,) = gw.names()
    families = list(text_string_to_metric_families(text))
    assert not [f.name for f in families if f.name.endswith("_created")]
    assert "_created" not in text
    labels = {label for f in families for s in f.samples for label in s.labels}
    assert "instance" not in labels
    assert "job" not in labels
    samples = {(s.name, frozenset(s.labels.items())): s.value for f in families for s in f.samples}
    assert series(samples, "gateway_instance_up", server=server) == 1
    assert (("gateway_instance_vllm_kv_cache_usage_ratio", frozenset({("server", server)}))) in (
        samples
    )
    statuses = {dict(ls)["status"] for (n, ls) in samples if n == "gateway_instance_requests_total"}
    assert statuses
    assert all(s.isdigit() for s in statuses)
    assert series(samples, "process_cpu_seconds_total") is not None
    assert (series(samples, "process_resident_memory_bytes") or 0) > 0
    build = {
        "version": __version__,
        "python": platform.python_version(),
        "aiohttp": aiohttp.__version__,
    }
    assert series(samples, "gateway_build_info", **build) == 1


async def test_admin_instances_names_the_long_lane_by_the_prefill_tag() -> None:
    """An instance configured lane = "long" is shown in the lane metrics call it ([prefill] tag)."""
    async with fleet(SimConfig(instant=True), SimConfig(instant=True)) as sims:
        instances = [
            {"url": sims[0].url, "name": "short0"},
            {"url": sims[1].url, "lane": "long", "name": "long0"},
        ]
        async with (
            gateway_with(sims, instances=instances, sections={"prefill": {"tag": "bulk"}}) as gw,
            aiohttp.ClientSession() as session,
            session.get(gw.url + "/admin/instances", headers=AUTH) as r,
        ):
            body = await r.json()
            text = await scrape_text(gw)
    lanes = {i["name"]: i["lane"] for i in body["instances"]}
    assert lanes == {"short0": "any", "long0": "bulk"}
    assert set(body["queues"]) == {"short", "bulk"}
    assert 'gateway_queue_depth{lane="bulk"}' in text


async def test_probes_and_scrapes_log_at_debug_until_they_fail() -> None:
    """Successful /healthz and /metrics answers log at debug; a 503 from /readyz at info."""
    async with (
        fleet(SimConfig(instant=True)) as sims,
        gateway_with(sims) as gw,
        aiohttp.ClientSession() as session,
    ):
        with structlog.testing.capture_logs() as events:
            for path in ("/healthz", "/metrics"):
                async with session.get(gw.url + path) as r:
                    assert r.status == 200
            gw.lifecycle.draining = True
            async with session.get(gw.url + "/readyz") as r:
                assert r.status == 503
        samples = await scrape(gw)
    levels = {(e["route"], e["status"]): e["log_level"] for e in access_lines(events)}
    assert levels == {("healthz", 200): "debug", ("metrics", 200): "debug", ("readyz", 503): "info"}
    unplaced = {"lane": "none", "model": "none", "tag": "none"}
    name = "gateway_requests_total"
    assert series(samples, name, route="healthz", status="200", **unplaced) == 1
    assert series(samples, name, route="readyz", status="503", **unplaced) == 1
