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
    the alert table of the Metrics section lists each alert once, in the same order."""
    names = [rule["alert"] for rule in rules()]
    assert len(set(names)) == len(names)
    assert runbook_sections() == names
    table = re.findall(r"^\| `(Gateway\w+)` \|", OPERATIONS.read_text(encoding="utf-8"), re.M)
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
