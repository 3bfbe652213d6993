"""Grafana dashboard: structure, datasource wiring, and every query parses as PromQL (offline)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml
from deploy_testlib import APT_HINT, require_tool
from promql import substitute_grafana

DS_REF = "${DS_PROMETHEUS}"


def all_panels(dashboard: dict) -> list[dict]:
    panels = list(dashboard["panels"])
    for p in dashboard["panels"]:
        panels += p.get("panels", [])
    return panels


def test_structure(dashboard) -> None:
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert dashboard["uid"] and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    panels = all_panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels:
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == DS_REF, f"{p['title']}: use the datasource variable"
        assert p.get("targets"), f"{p['title']}: no queries"
        for t in p["targets"]:
            assert t["datasource"]["uid"] == DS_REF and t["expr"].strip()
            # Variables only inside regex matchers: "All" becomes .*, which `=` would not match.
            for m in re.finditer(r'(\w+)\s*(=~|!~|!=|=)\s*"[^"]*\$', t["expr"]):
                assert m.group(2) == "=~", f"{p['title']}: use =~ with ${m.group(1)}"


def test_required_panels(dashboard) -> None:
    exprs = "\n".join(t["expr"] for p in all_panels(dashboard) for t in p.get("targets", []))
    for needle in (
        "prefill_graph_capture_memory_bytes",
        "prefill_graph_retained_input_bytes",
        "prefill_kv_capacity_tokens",
        "prefill_kv_used_tokens",
        "prefill_kv_usage_ratio",
        "histogram_quantile(0.5, sum by (le) (rate(prefill_time_to_first_token_seconds_bucket",
        "histogram_quantile(0.99, sum by (le) (rate(prefill_time_to_first_token_seconds_bucket",
        "rate(prefill_prompt_tokens_total",
        "prefill_queue_requests",
        "prefill_running_requests",
        "prefill_queue_limit_requests",
        "sum by (mode) (rate(prefill_forwards_total",
        "sum by (status) (rate(prefill_requests_total",
        "sum by (task) (rate(prefill_task_requests_total",
        "rate(prefill_kv_transfer_notified_requests_total",
        "prefill_kv_transfer_leased_pages",
    ):
        assert needle in exprs, f"no panel queries {needle}"


def test_queries_parse(dashboard, tmp_path: Path) -> None:
    """promtool has no offline PromQL parser, but it parses recording rules: wrap each query."""
    promtool = require_tool("promtool", APT_HINT)
    rules = [
        {"record": f"dashboard:query_{i}", "expr": substitute_grafana(t["expr"])}
        for i, t in enumerate(t for p in all_panels(dashboard) for t in p.get("targets", []))
    ]
    (tmp_path / "queries.yml").write_text(
        yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]})
    )
    res = subprocess.run(
        [promtool, "check", "rules", "queries.yml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr
