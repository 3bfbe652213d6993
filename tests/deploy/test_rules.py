"""PrometheusRule alerts: `promtool check rules`, and `promtool test rules` cases for the logic."""

from __future__ import annotations

import copy
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from deploy_testlib import APT_HINT, require_tool

GIB = 1024**3


def available(namespace: str, deployment: str = "triton-prefill") -> str:
    """kube-state-metrics' series of a Deployment's available replicas."""
    return (
        "kube_deployment_status_replicas_available"
        f'{{job="kube-state-metrics", namespace="{namespace}", deployment="{deployment}"}}'
    )


def queue(pod: str, queued: str, limit: str) -> dict[str, str]:
    """A pod's queue depth and queue limit, with the same labels as the service exports them."""
    labels = f'{{job="triton-prefill", pod="{pod}", model_name="m"}}'
    return {
        f"prefill_queue_requests{labels}": queued,
        f"prefill_queue_limit_requests{labels}": limit,
    }


def ttft_buckets(namespace: str, per_minute: dict[str, float]) -> dict[str, str]:
    """Cumulative TTFT histogram buckets of two pods, each growing by `per_minute` (by le)."""
    return {
        "prefill_time_to_first_token_seconds_bucket{"
        f'job="triton-prefill", namespace="{namespace}", pod="{pod}", le="{le}"}}': f"0+{n}x30"
        for pod in ("p0", "p1")
        for le, n in per_minute.items()
    }


# Input series and the alerts expected from them. Each alert has a case where it fires and series
# that must not fire it (the expected list names every firing alert of that name at that time).
# Times are minutes; series are sampled every minute starting at 0.
CASES = [
    {
        "name": "not ready: own gauge at 0, or target down, for 15m",
        "series": {
            'prefill_ready{job="triton-prefill", pod="stuck"}': "0x30",
            'prefill_ready{job="triton-prefill", pod="fine"}': "1x30",
            'prefill_ready{job="triton-prefill", pod="slow-start"}': "0x5 1x25",
            'up{job="triton-prefill", pod="stuck"}': "1x30",
            'up{job="triton-prefill", pod="fine"}': "1x30",
            'up{job="triton-prefill", pod="slow-start"}': "1x30",
            'up{job="triton-prefill", pod="down"}': "0x30",
            'up{job="other", pod="x"}': "0x30",
        },
        "alerts": {
            "PrefillNotReady": {
                14: [],
                16: [
                    {"severity": "critical", "job": "triton-prefill", "pod": "stuck"},
                    {"severity": "critical", "job": "triton-prefill", "pod": "down"},
                ],
            },
        },
    },
    {
        "name": "no available replica for 5m (kube-state-metrics)",
        "series": {
            available("a"): "0x20",
            available("b"): "1x20",
            available("c"): "0x3 1x17",
            available("a", deployment="other"): "0x20",
        },
        "alerts": {
            "PrefillNoAvailableReplicas": {
                4: [],
                7: [
                    {
                        "severity": "critical",
                        "job": "kube-state-metrics",
                        "namespace": "a",
                        "deployment": "triton-prefill",
                    }
                ],
            },
        },
    },
    {
        "name": "KV usage above 0.9 for 10m",
        "series": {
            'prefill_kv_usage_ratio{job="triton-prefill", pod="full"}': "0.5 0.95x20",
            'prefill_kv_usage_ratio{job="triton-prefill", pod="busy"}': "0.85x20",
            'prefill_kv_usage_ratio{job="triton-prefill", pod="spike"}': "0.95x3 0.5x17",
        },
        "alerts": {
            "PrefillKVCacheNearlyFull": {
                10: [],
                15: [{"severity": "warning", "job": "triton-prefill", "pod": "full"}],
            },
        },
    },
    {
        "name": "queue growing and long",
        "series": {
            # 10, 14, 18, ...: above 64 from minute 14, growing throughout.
            'prefill_queue_requests{job="triton-prefill", pod="growing"}': "10+4x40",
            'prefill_queue_requests{job="triton-prefill", pod="long-flat"}': "100x40",
            'prefill_queue_requests{job="triton-prefill", pod="short-growing"}': "0+1x40",
        },
        "alerts": {
            "PrefillQueueGrowing": {
                20: [],
                30: [{"severity": "warning", "job": "triton-prefill", "pod": "growing"}],
            },
        },
    },
    {
        "name": "queue held near its limit (flat, so deriv is 0)",
        "series": {
            **queue("stuck", queued="256x20", limit="256x20"),
            **queue("busy", queued="200x20", limit="256x20"),
            **queue("burst", queued="256x2 10x18", limit="256x20"),
        },
        "alerts": {
            "PrefillQueueFull": {
                4: [],
                7: [
                    {
                        "severity": "warning",
                        "job": "triton-prefill",
                        "pod": "stuck",
                        "model_name": "m",
                    }
                ],
            },
            "PrefillQueueGrowing": {15: []},
        },
    },
    {
        # Per minute: namespace slow answers 100 prompts in 5-10 s; namespace fast answers 1,000
        # in under 1 s and 5 in 5-10 s (0.5 %, so its p99 stays under 1 s). Two pods each.
        "name": "TTFT p99 above 5 s for 10m",
        "series": {
            **ttft_buckets("slow", {"1": 0, "5": 0, "10": 50, "+Inf": 50}),
            **ttft_buckets("fast", {"1": 500, "5": 500, "10": 502.5, "+Inf": 502.5}),
        },
        "alerts": {
            "PrefillTimeToFirstTokenHigh": {
                9: [],
                15: [{"severity": "warning", "job": "triton-prefill", "namespace": "slow"}],
            },
        },
    },
    {
        "name": "graph capture memory above 2 GiB",
        "series": {
            'prefill_graph_capture_memory_bytes{job="triton-prefill", pod="big"}': f"{3 * GIB}x10",
            'prefill_graph_capture_memory_bytes{job="triton-prefill", pod="ok"}': f"{GIB}x10",
        },
        "alerts": {
            "PrefillGraphCaptureMemoryHigh": {
                3: [],
                8: [{"severity": "warning", "job": "triton-prefill", "pod": "big"}],
            },
        },
    },
    {
        "name": "error and rejection ratios",
        "series": {
            # namespace a: 10 errors + 5 rejections per 115 requests; namespace b: 1 error per 101.
            'prefill_requests_total{namespace="a", status="ok"}': "0+100x30",
            'prefill_requests_total{namespace="a", status="error"}': "0+10x30",
            'prefill_requests_total{namespace="a", status="rejected"}': "0+5x30",
            'prefill_requests_total{namespace="b", status="ok"}': "0+100x30",
            'prefill_requests_total{namespace="b", status="error"}': "0+1x30",
            'prefill_requests_total{namespace="b", status="rejected"}': "0x30",
        },
        "alerts": {
            "PrefillHighErrorRate": {
                4: [],
                10: [{"severity": "critical", "namespace": "a"}],
            },
            "PrefillRequestsRejected": {
                9: [],
                15: [{"severity": "warning", "namespace": "a"}],
            },
        },
    },
]


@pytest.fixture(scope="module")
def promtool() -> str:
    return require_tool("promtool", APT_HINT)


def promtool_run(promtool: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )


def alert_rules(groups: list[dict]) -> dict[str, dict]:
    return {r["alert"]: r for g in groups for r in g["rules"] if "alert" in r}


def test_promtool_check_rules(promtool: str, rule_groups, tmp_path: Path) -> None:
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": rule_groups}))
    res = promtool_run(promtool, "check", "rules", "rules.yml", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"SUCCESS: {sum(len(g['rules']) for g in rule_groups)} rules found" in res.stdout


def test_every_alert_has_a_firing_case(rule_groups) -> None:
    tested = {name for case in CASES for name, at in case["alerts"].items() if any(at.values())}
    assert set(alert_rules(rule_groups)) <= tested, set(alert_rules(rule_groups)) - tested


def test_alert_logic(promtool: str, rule_groups, tmp_path: Path) -> None:
    # Annotations are stripped here so the logic tests do not restate their wording;
    # test_alert_annotations_render covers the templates.
    logic_groups = copy.deepcopy(rule_groups)
    for g in logic_groups:
        for r in g["rules"]:
            r.pop("annotations", None)
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": logic_groups}))
    tests = []
    for case in CASES:
        tests.append(
            {
                "name": case["name"],
                "interval": "1m",
                "input_series": [{"series": s, "values": v} for s, v in case["series"].items()],
                "alert_rule_test": [
                    {
                        "eval_time": f"{t}m",
                        "alertname": name,
                        "exp_alerts": [{"exp_labels": labels} for labels in expected],
                    }
                    for name, at in case["alerts"].items()
                    for t, expected in at.items()
                ],
            }
        )
    (tmp_path / "tests.yml").write_text(
        yaml.safe_dump(
            {"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": tests},
            sort_keys=False,
        )
    )
    res = promtool_run(promtool, "test", "rules", "tests.yml", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr


def render(template: str, labels: dict[str, str], value: float) -> str:
    """The few Go-template forms our annotations use, rendered like Prometheus does."""

    def sub(m: re.Match) -> str:
        expr = m.group(1).strip()
        if expr.startswith("$labels."):
            name = expr.removeprefix("$labels.")
            assert name in labels, f"annotation uses $labels.{name}, which the alert does not carry"
            return labels[name]
        if expr == "$value | humanizePercentage":
            return f"{value * 100:.4g}%"
        raise AssertionError(f"extend render() for {{{{ {expr} }}}}")

    return re.sub(r"\{\{(.*?)\}\}", sub, template)


def test_alert_annotations_render(promtool: str, rule_groups, tmp_path: Path) -> None:
    rule = alert_rules(rule_groups)["PrefillKVCacheNearlyFull"]
    labels = {"job": "triton-prefill", "namespace": "llm", "pod": "prefill-0"}
    value = 0.95
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": rule_groups}))
    series = "prefill_kv_usage_ratio{" + ", ".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
    test = {
        "interval": "1m",
        "input_series": [{"series": series, "values": f"{value}x20"}],
        "alert_rule_test": [
            {
                "eval_time": "15m",
                "alertname": "PrefillKVCacheNearlyFull",
                "exp_alerts": [
                    {
                        "exp_labels": {**labels, **rule["labels"]},
                        "exp_annotations": {
                            k: render(v, labels, value) for k, v in rule["annotations"].items()
                        },
                    }
                ],
            }
        ],
    }
    (tmp_path / "tests.yml").write_text(
        yaml.safe_dump({"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": [test]})
    )
    res = promtool_run(promtool, "test", "rules", "tests.yml", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
