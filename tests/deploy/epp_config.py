"""The endpoint picker's configuration (deploy/components/inference-gateway/epp-config.yaml).

What llm-d-router v0.10.0 accepts, and how it reads a metric, restated for the tests: the picker
decodes the file strictly (unknown keys stop it), its `core-metrics-extractor` maps the model-server
protocol's metrics to names per engine (`engineConfigs`), and each name is a "metric spec", a
PromQL-like `name{label="value",...}` selector (apix/config/v1alpha1/endpointpickerconfig_types.go,
pkg/epp/framework/plugins/datalayer/{extractor,source}/metrics/ at tag v0.10.0).
"""

from __future__ import annotations

import re
from typing import Any

from deploy_testlib import DEPLOY, load_yaml_docs

EPP_CONFIG = DEPLOY / "components" / "inference-gateway" / "epp-config.yaml"
EPP_VERSION = "v0.10.0"  # the llm-d-router release all of the below is read from
API_VERSION = "llm-d.ai/v1alpha1"
KIND = "EndpointPickerConfig"

# Plugin types this config may use, with the parameters each accepts (their Go structs' json tags).
PLUGIN_PARAMETERS: dict[str, set[str]] = {
    "metrics-data-source": {
        "scheme",
        "path",
        "port",
        "insecureSkipVerify",
        "caCertPath",
        "clientCertPath",
        "clientKeyPath",
        "interval",
    },
    "core-metrics-extractor": {"engineLabelKey", "defaultEngine", "engineConfigs"},
    "queue-scorer": set(),
    "kv-cache-utilization-scorer": set(),
    "prefix-cache-scorer": {
        "prefixMatchInfoProducerName",
        "matchLengthWeight",
        "matchLengthScaleTokens",
    },
    "openai-parser": set(),
    "passthrough-parser": set(),
    # P/D (deploy/components/pd-disaggregation): pkg/epp/framework/plugins/scheduling/...
    "prefill-filter": set(),
    "decode-filter": set(),
    "max-score-picker": {"maxNumOfEndpoints"},
    "prefix-based-pd-decider": {"nonCachedTokens", "promptTokens"},
    "disagg-profile-handler": {"stageOrder", "profiles", "deciders"},
}
ENGINE_CONFIG_KEYS = {
    "name",
    "queuedRequestsSpec",
    "runningRequestsSpec",
    "kvUsageSpec",
    "loraSpec",
    "cacheInfoSpec",
    "cacheBlockSizeLabelName",
    "cacheNumBlocksLabelName",
    "cacheBlockSizeSpec",
    "cacheNumBlocksSpec",
    "customMetrics",
}
BUILTIN_ENGINES = {"vllm", "sglang", "trtllm-serve", "triton-tensorrt-llm", "triton"}
# The extractor's label names for the cache-config info metric when an engine names none.
DEFAULT_CACHE_LABELS = ("block_size", "num_gpu_blocks")

_TOP_LEVEL = {
    "apiVersion",
    "kind",
    "featureGates",
    "plugins",
    "schedulingProfiles",
    "dataLayer",
    "flowControl",
    "requestHandler",
    "saturationDetector",
    "parser",
}
_METRIC_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


def load() -> dict:
    (doc,) = load_yaml_docs(EPP_CONFIG.read_text())
    return doc


def parse_metric_spec(spec: str) -> tuple[str, dict[str, str]]:
    """`name{label="value",...}` -> (name, labels), as the picker's parseStringToSpec reads it."""
    quoted = re.sub(r'(\w+)\s*=\s*([^",}\s]+)', r'\1="\2"', spec)  # label=value -> label="value"
    m = re.fullmatch(r"\s*(\S+?)\s*(?:\{([^}]*)\})?\s*", quoted)
    if not m or not _METRIC_NAME.match(m[1]):
        raise ValueError(f"not a valid metric specification: {spec!r}")
    labels = {}
    for pair in filter(str.strip, (m[2] or "").split(",")):
        lm = re.fullmatch(r'\s*(\S+?)\s*=\s*"([^"]*)"\s*', pair)
        if not lm or not _LABEL_NAME.match(lm[1]):
            raise ValueError(f"invalid label pair {pair!r} in {spec!r}")
        labels[lm[1]] = lm[2]
    return m[1], labels


def plugin(doc: dict, plugin_type: str) -> dict:
    (found,) = [p for p in doc["plugins"] if p["type"] == plugin_type]
    return found


def engine(doc: dict) -> dict:
    """The engine config the extractor applies to our pods (its defaultEngine)."""
    params = plugin(doc, "core-metrics-extractor")["parameters"]
    (found,) = [e for e in params["engineConfigs"] if e["name"] == params["defaultEngine"]]
    return found


def read_metrics(doc: dict) -> dict[str, tuple[str, dict[str, str]]]:
    """What the picker reads from our /metrics: its key -> (metric name, label matchers)."""
    eng = engine(doc)
    return {
        key: parse_metric_spec(eng[key])
        for key in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "cacheInfoSpec")
    }


def cache_info_labels(doc: dict) -> tuple[str, str]:
    """The label names the picker parses block size and block count from, on the info metric."""
    eng = engine(doc)
    return (
        eng.get("cacheBlockSizeLabelName") or DEFAULT_CACHE_LABELS[0],
        eng.get("cacheNumBlocksLabelName") or DEFAULT_CACHE_LABELS[1],
    )


def _unknown(obj: Any, allowed: set[str], where: str) -> list[str]:
    if not isinstance(obj, dict):
        return [f"{where}: must be a mapping"]
    return [f"{where}: unknown field {k!r}" for k in sorted(set(obj) - allowed)]


def check_endpoint_picker_config(doc: dict) -> list[str]:
    """Problems the picker would stop on: unknown keys, unknown plugins, dangling references,
    metric specs it cannot parse, an extractor without its default engine."""
    problems = _unknown(doc, _TOP_LEVEL, "<root>")
    plugins = doc.get("plugins") or []
    names = [p.get("name") or p.get("type") for p in plugins]
    if len(set(names)) != len(names):
        problems.append(f"plugin names must be unique: {names}")
    for i, p in enumerate(plugins):
        where = f"plugins[{i}]"
        problems += _unknown(p, {"name", "type", "parameters"}, where)
        if p.get("type") not in PLUGIN_PARAMETERS:
            problems.append(f"{where}: plugin type {p.get('type')!r} is not one this test knows")
            continue
        params = p.get("parameters") or {}
        problems += _unknown(params, PLUGIN_PARAMETERS[p["type"]], f"{where}.parameters")
        if p["type"] == "core-metrics-extractor":
            problems += _check_extractor(params, f"{where}.parameters")
        if p["type"] == "metrics-data-source" and "port" in params:
            if not (isinstance(params["port"], int) and 1 <= params["port"] <= 65535):
                problems.append(f"{where}.parameters.port must be a port number")

    def ref(r: Any, where: str) -> list[str]:
        if not isinstance(r, dict) or r.get("pluginRef") not in names:
            return [f"{where}: pluginRef must name a plugin, got {r!r}"]
        return []

    for i, prof in enumerate(doc.get("schedulingProfiles") or []):
        problems += _unknown(prof, {"name", "plugins"}, f"schedulingProfiles[{i}]")
        for j, sp in enumerate(prof.get("plugins") or []):
            problems += _unknown(sp, {"pluginRef", "weight"}, f"schedulingProfiles[{i}][{j}]")
            problems += ref(sp, f"schedulingProfiles[{i}].plugins[{j}]")
    data = doc.get("dataLayer") or {}
    problems += _unknown(
        data,
        {
            "injectDefaults",
            "sources",
            "discovery",
            "crossReplicaSyncerPluginRef",
            "crossReplicaSyncInterval",
        },
        "dataLayer",
    )
    for i, src in enumerate(data.get("sources") or []):
        problems += _unknown(src, {"pluginRef", "extractors"}, f"dataLayer.sources[{i}]")
        problems += ref(src, f"dataLayer.sources[{i}]")
        for j, ext in enumerate(src.get("extractors") or []):
            problems += ref(ext, f"dataLayer.sources[{i}].extractors[{j}]")
    handler = doc.get("requestHandler") or {}
    problems += _unknown(handler, {"parsers"}, "requestHandler")
    for i, parser in enumerate(handler.get("parsers") or []):
        problems += ref(parser, f"requestHandler.parsers[{i}]")
    return problems


def _check_extractor(params: dict, where: str) -> list[str]:
    problems = []
    engines = params.get("engineConfigs") or []
    for i, eng in enumerate(engines):
        problems += _unknown(eng, ENGINE_CONFIG_KEYS, f"{where}.engineConfigs[{i}]")
        for key, spec in eng.items():
            if key.endswith("Spec") and spec:
                try:
                    parse_metric_spec(spec)
                except ValueError as e:
                    problems.append(f"{where}.engineConfigs[{i}].{key}: {e}")
    default = params.get("defaultEngine", "vllm")
    if default not in {e.get("name") for e in engines} | BUILTIN_ENGINES:
        problems.append(f"{where}: defaultEngine {default!r} is not in engineConfigs")
    return problems


CONFIG_CHECKS = {(API_VERSION, KIND): check_endpoint_picker_config}
