"""The alert rules and the dashboard, checked without Prometheus: what promtool cannot see.

Every alert links its runbook, a section of docs/operations.md that exists (anchors as
GitHub makes them), and every runbook section is an alert's; the alert table lists them
all; the job the rules select is the one the shipped scrape configs give the gateway; every
dashboard query is scoped by the job and instance variables. promtool's checks and a real
Prometheus are in tests/functional/test_prometheus.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
EXAMPLE_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
SERVICE_MONITOR = ROOT / "deploy" / "kubernetes" / "servicemonitor.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "gateway-dashboard.json"
OPERATIONS = ROOT / "docs" / "operations.md"
OBSERVABILITY = ROOT / "docs" / "observability.md"  # the alert table, with the metrics
# The placeholder the rules' header says to replace; the anchor is the alert's name.
RUNBOOKS = "https://github.com/OWNER/REPO/blob/main/docs/operations.md#"
SCOPE = ('job=~"$job"', 'instance=~"$instance"')


def rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def headings(markdown: str) -> list[tuple[int, str]]:
    """(level, text) of each heading, those in fenced code blocks left out."""
    found, fenced = [], False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"(#{1,6}) (.+)", line)):
            found.append((len(m.group(1)), m.group(2).strip()))
    return found


def anchor(text: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Every heading's anchor; a repeated one gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for _, text in headings(markdown):
        slug = anchor(text)
        out.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return out


def runbook_sections() -> list[str]:
    """The subsections of "## Runbooks" in docs/operations.md."""
    inside, found = False, []
    for level, text in headings(OPERATIONS.read_text(encoding="utf-8")):
        if level == 2:
            inside = text == "Runbooks"
        elif inside and level == 3:
            found.append(text)
    return found


def test_the_anchors_are_githubs() -> None:
    """Code spans and punctuation leave the anchor; a repeated heading is numbered."""
    assert anchor("`GatewayInstanceDown`") == "gatewayinstancedown"
    assert anchor("Drain (SIGTERM)") == "drain-sigterm"
    assert anchors("## A\n```\n## B\n```\n## A\n") == {"a", "a-1"}


def test_every_alert_links_its_runbook_in_the_operations_guide() -> None:
    """runbook_url is the placeholder base and the alert's own anchor, which exists."""
    existing = anchors(OPERATIONS.read_text(encoding="utf-8"))
    for rule in rules():
        url = rule["annotations"].get("runbook_url", "")
        assert url == RUNBOOKS + rule["alert"].lower(), rule["alert"]
        assert url.removeprefix(RUNBOOKS) in existing, f"no runbook section for {url}"


def test_every_runbook_section_is_an_alert_and_every_alert_is_in_the_table() -> None:
    """The Runbooks section has one subsection per alert, no more, in the rules' order;
    the alert table of the Metrics section (observability.md) lists each alert once, in the
    same order."""
    names = [rule["alert"] for rule in rules()]
    assert len(set(names)) == len(names)
    assert runbook_sections() == names
    table = re.findall(r"^\| `(Gateway\w+)` \|", OBSERVABILITY.read_text(encoding="utf-8"), re.M)
    assert table == names


def test_the_job_the_alerts_select_is_the_one_the_shipped_configs_scrape() -> None:
    """up{job=...} names the example config's job, which the ServiceMonitor sets too (the
    Prometheus Operator would otherwise name the job after the Service)."""
    selected = {job for rule in rules() for job in re.findall(r'\bjob="([^"]+)"', rule["expr"])}
    assert len(selected) == 1, selected
    (job,) = selected
    jobs = [c["job_name"] for c in yaml.safe_load(EXAMPLE_CONFIG.read_text())["scrape_configs"]]
    assert jobs == [job]
    (endpoint,) = yaml.safe_load(SERVICE_MONITOR.read_text())["spec"]["endpoints"]
    sets_job = [r for r in endpoint["relabelings"] if r["targetLabel"] == "job"]
    assert sets_job == [{"action": "replace", "targetLabel": "job", "replacement": job}]


def dashboard() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return document


def exprs(node: Any) -> list[str]:
    if isinstance(node, dict):
        own = [node["expr"]] if "expr" in node else []
        return own + [e for v in node.values() for e in exprs(v)]
    if isinstance(node, list):
        return [e for v in node for e in exprs(v)]
    return []


_SELECTOR = re.compile(r"(?<![\w:])((?:gateway|process)_\w+)(\{[^}]*\})?")


def test_every_dashboard_query_is_scoped_by_job_and_instance() -> None:
    """Each series a panel reads is selected by the job and instance variables."""
    queries = exprs(dashboard()["panels"])
    assert len(queries) >= 40
    for expr in queries:
        selectors = _SELECTOR.findall(expr)
        assert selectors, expr
        for metric, matchers in selectors:
            assert all(m in matchers for m in SCOPE), f"{metric} unscoped in {expr}"


def test_the_dashboard_variables_narrow_job_then_instance_then_server() -> None:
    """job and instance are Prometheus' target labels of the gateway's processes; each
    variable's values are those of the ones before it."""
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert list(variables) == ["datasource", "job", "instance", "server"]
    assert variables["job"]["query"]["query"] == "label_values(gateway_build_info, job)"
    assert variables["instance"]["query"]["query"] == (
        'label_values(gateway_build_info{job=~"$job"}, instance)'
    )
    assert variables["server"]["query"]["query"] == (
        'label_values(gateway_instance_up{job=~"$job", instance=~"$instance"}, server)'
    )
    for name in ("job", "instance", "server"):
        assert (variables[name]["includeAll"], variables[name]["allValue"]) == (True, ".*")


def panels(nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every panel and row, those nested in a collapsed row included."""
    return [p for node in nodes for p in (node, *panels(node.get("panels", [])))]


def test_panel_ids_are_unique() -> None:
    """Grafana keys a panel's state (links, edits, repeats) by its id: no two share one."""
    ids = [p["id"] for p in panels(dashboard()["panels"])]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)


def test_no_panel_overlaps_another() -> None:
    """Each panel has its own place on the grid (Grafana would push one down at random)."""
    taken: dict[tuple[int, int], str] = {}
    for panel in panels(dashboard()["panels"]):
        grid = panel["gridPos"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in taken, (panel["title"], taken.get((x, y)))
                taken[x, y] = panel["title"]


# What a panel must show, by the series it reads and the labels it sums by.
SHOWN = {
    "Requests by key and outcome": ("gateway_key_requests_total", "by (key, outcome)"),
    "Tokens by key": ("gateway_key_tokens_total", "by (key, kind)"),
    "Service share by key": ("gateway_key_service_total", "by (key)"),
    "Prefill fallbacks by reason": ("gateway_prefill_fallbacks_total", "by (reason)"),
    "Prefix-cache hit rate per server": (
        "gateway_instance_vllm_prefix_cache_hit_tokens_total",
        "by (server)",
    ),
    "Fleet saturation by model": ("gateway_fleet_saturation", "by (model)"),
    "Metrics scrape age per server": ("gateway_instance_scrape_age_seconds", "by (server)"),
    "Stream migrations by reason and outcome": (
        "gateway_migrations_total",
        "by (reason, outcome)",
    ),
}


def test_keys_capacity_and_cache_each_have_one_panel() -> None:
    """Each of these is shown by exactly one panel, which reads its series by its labels,
    and no other panel reads those series (service share by key is not shown twice)."""
    by_title = {p["title"]: exprs(p.get("targets", [])) for p in panels(dashboard()["panels"])}
    for title, (metric, grouping) in SHOWN.items():
        assert title in by_title, title
        assert any(metric in e and grouping in e for e in by_title[title]), (title, metric)
        readers = [t for t, es in by_title.items() if any(metric in e for e in es)]
        assert readers == [title], (metric, readers)
