"""Structural checks for the CRD kinds under deploy/ that kubernetes-validate has no schema for.

Each check returns a list of problems (empty = valid). They cover the fields the operators
(Prometheus Operator, KEDA) require and reject unknown keys where a typo would silently drop
configuration (a misspelt `endpoints` key means nothing is scraped). The InferencePool is checked
against its released CRD (crd_schemas.py), the endpoint picker's configuration by epp_config.py.
"""

from __future__ import annotations

import re
from typing import Any

from crd_schemas import check_against_crd
from epp_config import CONFIG_CHECKS

DURATION = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")


def _unknown(obj: dict, allowed: set[str], where: str) -> list[str]:
    return [f"{where}: unknown field {k!r}" for k in sorted(set(obj) - allowed)]


def _metadata(doc: dict) -> list[str]:
    meta = doc.get("metadata")
    if not isinstance(meta, dict) or not meta.get("name"):
        return ["metadata.name is required"]
    problems = []
    for key in ("labels", "annotations"):
        vals = meta.get(key, {})
        if not isinstance(vals, dict) or not all(isinstance(v, str) for v in vals.values()):
            problems.append(f"metadata.{key} must map strings to strings")
    return problems


def _label_selector(sel: Any, where: str) -> list[str]:
    if not isinstance(sel, dict) or not (sel.get("matchLabels") or sel.get("matchExpressions")):
        return [f"{where}: needs matchLabels or matchExpressions"]
    return _unknown(sel, {"matchLabels", "matchExpressions"}, where)


def _spec(doc: dict) -> tuple[list[str], dict | None]:
    """The metadata's problems and the spec (None, with a problem, when it is not a mapping)."""
    problems = _metadata(doc)
    spec = doc.get("spec")
    if not isinstance(spec, dict):
        return [*problems, "spec is required"], None
    return problems, spec


def check_service_monitor(doc: dict) -> list[str]:
    problems, spec = _spec(doc)
    if spec is None:
        return problems
    problems += _unknown(
        spec,
        {
            "selector",
            "endpoints",
            "namespaceSelector",
            "jobLabel",
            "targetLabels",
            "podTargetLabels",
            "sampleLimit",
            "targetLimit",
            "attachMetadata",
        },
        "spec",
    )
    problems += _label_selector(spec.get("selector"), "spec.selector")
    endpoints = spec.get("endpoints")
    if not isinstance(endpoints, list) or not endpoints:
        return [*problems, "spec.endpoints must be a non-empty list"]
    for i, ep in enumerate(endpoints):
        where = f"spec.endpoints[{i}]"
        problems += _unknown(
            ep,
            {
                "port",
                "targetPort",
                "path",
                "scheme",
                "interval",
                "scrapeTimeout",
                "honorLabels",
                "honorTimestamps",
                "relabelings",
                "metricRelabelings",
                "params",
                "tlsConfig",
                "bearerTokenSecret",
                "authorization",
                "followRedirects",
                "enableHttp2",
            },
            where,
        )
        if not (ep.get("port") or ep.get("targetPort")):
            problems.append(f"{where}: needs port (a Service port name) or targetPort")
        if not str(ep.get("path", "/metrics")).startswith("/"):
            problems.append(f"{where}.path must start with /")
        for key in ("interval", "scrapeTimeout"):
            if key in ep and not DURATION.match(str(ep[key])):
                problems.append(f"{where}.{key}: {ep[key]!r} is not a Prometheus duration")
    return problems


def check_prometheus_rule(doc: dict) -> list[str]:
    problems = _metadata(doc)
    spec = doc.get("spec")
    if not isinstance(spec, dict) or not isinstance(spec.get("groups"), list) or not spec["groups"]:
        return [*problems, "spec.groups must be a non-empty list"]
    problems += _unknown(spec, {"groups"}, "spec")
    names = [g.get("name") for g in spec["groups"]]
    if len(set(names)) != len(names) or not all(names):
        problems.append(f"spec.groups need unique, non-empty names: {names}")
    for g in spec["groups"]:
        where = f"group {g.get('name')!r}"
        problems += _unknown(
            g, {"name", "interval", "rules", "partial_response_strategy", "limit"}, where
        )
        if "interval" in g and not DURATION.match(str(g["interval"])):
            problems.append(f"{where}.interval is not a duration")
        rules = g.get("rules")
        if not isinstance(rules, list) or not rules:
            problems.append(f"{where}: rules must be a non-empty list")
            continue
        for r in rules:
            rwhere = f"{where} rule {r.get('alert') or r.get('record')!r}"
            problems += _unknown(
                r,
                {"alert", "record", "expr", "for", "keep_firing_for", "labels", "annotations"},
                rwhere,
            )
            if ("alert" in r) == ("record" in r):
                problems.append(f"{rwhere}: exactly one of alert/record")
            if not isinstance(r.get("expr"), str) or not r["expr"].strip():
                problems.append(f"{rwhere}: expr must be a non-empty string")
            if "for" in r and not DURATION.match(str(r["for"])):
                problems.append(f"{rwhere}: for={r['for']!r} is not a duration")
            for key in ("labels", "annotations"):
                vals = r.get(key, {})
                if not isinstance(vals, dict) or not all(isinstance(v, str) for v in vals.values()):
                    problems.append(f"{rwhere}: {key} must map strings to strings")
            if "record" in r and "annotations" in r:
                problems.append(f"{rwhere}: recording rules take no annotations")
    return problems


def check_scaled_object(doc: dict) -> list[str]:
    problems, spec = _spec(doc)
    if spec is None:
        return problems
    problems += _unknown(
        spec,
        {
            "scaleTargetRef",
            "pollingInterval",
            "cooldownPeriod",
            "initialCooldownPeriod",
            "idleReplicaCount",
            "minReplicaCount",
            "maxReplicaCount",
            "fallback",
            "advanced",
            "triggers",
        },
        "spec",
    )
    target = spec.get("scaleTargetRef")
    if not isinstance(target, dict) or not target.get("name"):
        problems.append("spec.scaleTargetRef.name is required")
    lo, hi = spec.get("minReplicaCount", 0), spec.get("maxReplicaCount", 100)
    if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi):
        problems.append(f"replica counts must be ints with min <= max, got {lo}, {hi}")
    triggers = spec.get("triggers")
    if not isinstance(triggers, list) or not triggers:
        return [*problems, "spec.triggers must be a non-empty list"]
    for i, t in enumerate(triggers):
        meta = t.get("metadata")
        if not t.get("type") or not isinstance(meta, dict):
            problems.append(f"spec.triggers[{i}] needs type and metadata")
        elif not all(isinstance(v, str) for v in meta.values()):
            problems.append(
                f"spec.triggers[{i}].metadata values must be strings (KEDA parses them)"
            )
        elif t["type"] == "prometheus":
            for key in ("serverAddress", "query", "threshold"):
                if not meta.get(key):
                    problems.append(f"spec.triggers[{i}].metadata.{key} is required")
    return problems


CRD_CHECKS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): check_service_monitor,
    ("monitoring.coreos.com/v1", "PrometheusRule"): check_prometheus_rule,
    ("keda.sh/v1alpha1", "ScaledObject"): check_scaled_object,
    # against the released CRD itself (crds/)
    ("inference.networking.k8s.io/v1", "InferencePool"): check_against_crd,
    # not a Kubernetes object: the endpoint picker's configuration file
    **CONFIG_CHECKS,
}
