"""OpenTelemetry spans (the `otel` extra): one per request, one per attempt, in the
client's trace, with the instance's traceparent naming the attempt."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from fakes import KEY, Gateway, fleet, gateway_with, serving, write_config

from gateway.config import load as gateway_config
from gateway.server.resources import PROXY
from gateway.sim.sim_vllm import SimConfig

pytest.importorskip(
    "opentelemetry.sdk.trace",
    reason="the OpenTelemetry SDK is not installed (pip install '.[otel]')",
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.trace import SpanKind, StatusCode

from gateway.observe import tracing

FAST = SimConfig(decode_s_per_token=0.001, prefill_tokens_per_s=1e6)
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}


@pytest.fixture
async def traced() -> AsyncIterator[tuple[Gateway, InMemorySpanExporter]]:
    """Two instances in round-robin order behind a gateway exporting spans to memory."""
    async with (
        fleet(FAST, FAST) as sims,
        gateway_with(sims, sections={"dispatch": {"strategy": "round_robin"}}) as gw,
    ):
        exporter = InMemorySpanExporter()
        gw.app[PROXY].spans = tracing.start("http://unused", exporter=exporter)
        yield gw, exporter


async def chat(gw: Gateway, headers: dict[str, str]) -> aiohttp.ClientResponse:
    async with aiohttp.ClientSession() as s:
        resp = await s.post(
            gw.url + "/v1/chat/completions",
            json=CHAT,
            headers={"Authorization": f"Bearer {KEY}", **headers},
        )
        await resp.read()
        return resp


def by_kind(exporter: InMemorySpanExporter, kind: SpanKind) -> list[Any]:
    return [s for s in exporter.get_finished_spans() if s.kind == kind]


async def test_a_request_and_its_attempt_are_spans_in_the_clients_trace(
    traced: tuple[Gateway, InMemorySpanExporter],
) -> None:
    """The request span continues the client's trace; the attempt is its child; the
    instance gets a traceparent whose parent is the attempt span."""
    gw, exporter = traced
    resp = await chat(gw, {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
    assert resp.status == 200
    (request,) = by_kind(exporter, SpanKind.SERVER)
    (attempt,) = by_kind(exporter, SpanKind.CLIENT)
    assert f"{request.context.trace_id:032x}" == CLIENT_TRACE
    assert f"{request.parent.span_id:016x}" == CLIENT_SPAN
    assert attempt.parent.span_id == request.context.span_id
    assert attempt.context.trace_id == request.context.trace_id
    assert request.name == "POST /v1/chat/completions"
    instance = resp.headers["X-Gateway-Instance"]
    assert request.attributes[tracing.STATUS] == 200
    assert request.attributes[tracing.LANE] == "short"
    assert request.attributes[tracing.MODEL] == "sim-model"
    assert request.attributes[tracing.SERVER] == instance
    assert request.attributes[tracing.ATTEMPTS] == 1
    assert attempt.attributes[tracing.ATTEMPT] == 1
    assert attempt.attributes[tracing.SERVER] == instance
    assert attempt.attributes[tracing.STATUS] == 200
    seen = next(s for s in gw.sims if s.stats.requests).stats.last_headers["traceparent"]
    assert seen == f"00-{CLIENT_TRACE}-{attempt.context.span_id:016x}-01"


async def test_each_attempt_of_a_retried_request_is_a_span(
    traced: tuple[Gateway, InMemorySpanExporter],
) -> None:
    """A failed attempt and its retry are two attempt spans, the first marked an error."""
    gw, exporter = traced
    gw.sims[0].faults.status = 502
    # Round robin: of two requests, at least one is tried on the failing instance first.
    assert [(await chat(gw, {})).status for _ in range(2)] == [200, 200]
    retried = [s for s in by_kind(exporter, SpanKind.SERVER) if s.attributes[tracing.ATTEMPTS] == 2]
    assert retried
    request = retried[0]
    attempts = sorted(
        (
            s
            for s in by_kind(exporter, SpanKind.CLIENT)
            if s.parent.span_id == request.context.span_id
        ),
        key=lambda s: s.attributes[tracing.ATTEMPT],
    )
    assert [a.attributes[tracing.ATTEMPT] for a in attempts] == [1, 2]
    assert attempts[0].attributes[tracing.STATUS] == 502
    assert attempts[0].status.status_code is StatusCode.ERROR
    assert attempts[1].attributes[tracing.STATUS] == 200
    assert request.attributes[tracing.STATUS] == 200


async def test_without_a_client_trace_the_request_span_is_a_root_whose_id_is_logged(
    traced: tuple[Gateway, InMemorySpanExporter],
) -> None:
    """No traceparent: the request span starts the trace, and the log's trace_id is its id."""
    import structlog

    gw, exporter = traced
    with structlog.testing.capture_logs(
        processors=[structlog.contextvars.merge_contextvars]
    ) as events:
        await chat(gw, {})
    (request,) = by_kind(exporter, SpanKind.SERVER)
    assert request.parent is None
    (line,) = [e for e in events if e["event"] == "request"]
    assert line["trace_id"] == f"{request.context.trace_id:032x}"


async def test_an_unauthorized_request_is_a_span_too(
    traced: tuple[Gateway, InMemorySpanExporter],
) -> None:
    """A 401 ends its request span with the status, and no attempt is made."""
    gw, exporter = traced
    async with aiohttp.ClientSession() as s:
        resp = await s.post(gw.url + "/v1/chat/completions", json=CHAT)
        await resp.read()
    assert resp.status == 401
    (request,) = by_kind(exporter, SpanKind.SERVER)
    assert request.attributes[tracing.STATUS] == 401
    assert by_kind(exporter, SpanKind.CLIENT) == []


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, tracing.SERVICE_NAME),
        ({"OTEL_SERVICE_NAME": "gw-eu"}, "gw-eu"),
        ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=gw-us,team=ml"}, "gw-us"),
        (
            {"OTEL_SERVICE_NAME": "gw-eu", "OTEL_RESOURCE_ATTRIBUTES": "service.name=gw-us"},
            "gw-eu",
        ),
    ],
)
def test_the_service_is_named_by_the_environment_else_vllm_gateway(
    monkeypatch: pytest.MonkeyPatch, environ: dict[str, str], expected: str
) -> None:
    """The spans' service.name: OTEL_SERVICE_NAME, else OTEL_RESOURCE_ATTRIBUTES' one,
    else the gateway's own name (never the SDK's "unknown_service")."""
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    exporter = InMemorySpanExporter()
    tracing.start("http://unused", exporter=exporter).request("/v1/models", "GET", None).end(200)
    (span,) = exporter.get_finished_spans()
    assert span.resource.attributes["service.name"] == expected


@pytest.mark.parametrize(
    ("section", "environ", "expected"),
    [
        ({}, {}, None),
        ({"otlp_endpoint": "http://collector:4318"}, {}, "http://collector:4318/v1/traces"),
        ({"otlp_endpoint": "http://c:4318/v1/traces"}, {}, "http://c:4318/v1/traces"),
        ({}, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://env:4318/"}, "http://env:4318/v1/traces"),
        ({}, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:1/x"}, "http://t:1/x"),
        (
            {"otlp_endpoint": "http://file:4318"},
            {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:1/x"},
            "http://file:4318/v1/traces",
        ),
    ],
)
def test_where_spans_go(
    tmp_path: Path, section: dict[str, str], environ: dict[str, str], expected: str | None
) -> None:
    """[tracing] otlp_endpoint wins; else OpenTelemetry's standard variables; else off."""
    sections: dict[str, dict[str, Any]] = {"tracing": dict(section)} if section else {}
    path = write_config(tmp_path, ["http://127.0.0.1:9"], sections=sections)
    config = gateway_config.load(path, environ=environ)
    assert config.otlp_traces_url == expected


def test_without_the_extra_a_configured_endpoint_is_an_error_and_the_variable_is_ignored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the otel packages, the file's setting fails loading; the env variable alone
    (perhaps meant for other software) leaves tracing off."""
    monkeypatch.setattr(gateway_config, "_otel_installed", lambda: False)
    path = write_config(
        tmp_path, ["http://127.0.0.1:9"], sections={"tracing": {"otlp_endpoint": "http://c:4318"}}
    )
    with pytest.raises(gateway_config.ConfigError, match=r"tracing\.otlp_endpoint.*\[otel\]"):
        gateway_config.load(path, environ={})
    path = write_config(tmp_path, ["http://127.0.0.1:9"])
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://env:4318"}
    assert gateway_config.load(path, environ=env).otlp_traces_url is None


def test_a_bad_endpoint_is_a_config_error(tmp_path: Path) -> None:
    """otlp_endpoint must be an http(s) URL."""
    path = write_config(
        tmp_path, ["http://127.0.0.1:9"], sections={"tracing": {"otlp_endpoint": "collector:4318"}}
    )
    with pytest.raises(gateway_config.ConfigError, match="otlp_endpoint"):
        gateway_config.load(path, environ={})


def test_with_tracing_off_no_opentelemetry_module_is_imported() -> None:
    """A gateway that does not trace never imports gateway.observe.tracing or OpenTelemetry."""
    code = (
        "import sys, gateway.cli, gateway.process.serve, gateway.server.app\n"
        "import gateway.proxy.handler\n"
        "bad = [m for m in sys.modules if m.split('.')[0] == 'opentelemetry'\n"
        "       or m == 'gateway.observe.tracing']\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


async def test_spans_reach_an_otlp_http_collector(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the real exporter, spans arrive at the collector's /v1/traces as OTLP protobuf,
    under the service that OTEL_SERVICE_NAME names."""
    pytest.importorskip(
        "opentelemetry.exporter.otlp.proto.http",
        reason="the OTLP exporter is not installed (pip install '.[otel]')",
    )
    from aiohttp import web

    received: list[tuple[str, str, bytes]] = []

    async def collect(request: web.Request) -> web.Response:
        received.append((request.path, request.content_type, await request.read()))
        return web.Response(status=200)

    monkeypatch.setenv("OTEL_SERVICE_NAME", "gateway-otlp-test")
    app = web.Application()
    app.router.add_post("/v1/traces", collect)
    async with serving(app) as url:
        spans = tracing.start(f"{url}/v1/traces")
        span = spans.request("/v1/chat/completions", "POST", None)
        span.end(200, lane="short", model="m", request_id="r1")
        await asyncio.to_thread(spans.shutdown)  # flushes the batch; the loop serves it
    ((path, content_type, body),) = received
    assert path == "/v1/traces"
    assert content_type == "application/x-protobuf"
    assert b"gateway-otlp-test" in body
    assert b"POST /v1/chat/completions" in body
