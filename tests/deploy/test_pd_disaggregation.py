"""The pd-disaggregation component on top of inference-gateway: every object validates, the picker's
P/D configuration uses plugins llm-d-router v0.10.0 registers, and the prefill and decode pods
agree on ports, roles and the compatibility hash's factors."""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import PurePosixPath

import epp_config
import pytest
import yaml
from deploy_testlib import DEPLOY, OVERLAYS, effective_env, load_yaml_docs, named
from test_manifests import GATEWAY_KINDS, name_of, validate_doc

from service.config import Settings

PD_CONFIG = DEPLOY / "components" / "pd-disaggregation" / "epp-config.yaml"
PREFILL, DECODE, POOL = "triton-prefill", "vllm-decode", "triton-prefill"
ROLE = "llm-d.ai/role"
# Aliases v0.10.0 still registers but deprecates in favour of disagg-profile-handler.
DEPRECATED = {"pd-profile-handler", "prefill-header-handler", "disagg-headers-handler"}


@pytest.fixture(scope="module")
def rendered_pd(kustomize, tmp_path_factory) -> dict[str, list[dict]]:
    """Each overlay with inference-gateway and pd-disaggregation, by overlay name."""
    out = {}
    for name in OVERLAYS:
        root = tmp_path_factory.mktemp(f"pd-{name}")
        rel = partial(os.path.relpath, start=root)  # kustomize refuses absolute paths
        spec = {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "resources": [rel(DEPLOY / "overlays" / name)],
            "components": [
                rel(DEPLOY / "components" / c) for c in ("inference-gateway", "pd-disaggregation")
            ],
        }
        (root / "kustomization.yaml").write_text(yaml.safe_dump(spec))
        out[name] = kustomize(root)
    return out


def pod(docs: list[dict], name: str) -> dict:
    return named(docs, "Deployment", name)["spec"]["template"]


def container(docs: list[dict], name: str, container_name: str) -> dict:
    spec = pod(docs, name)["spec"]
    (found,) = [
        c
        for c in spec["containers"] + spec.get("initContainers", [])
        if c["name"] == container_name
    ]
    return found


def port_of(c: dict, name: str) -> int:
    (port,) = [p["containerPort"] for p in c["ports"] if p["name"] == name]
    return port


def args_of(c: dict) -> dict[str, str]:
    """`--flag=value` and `--flag value` arguments as {flag: value}."""
    out, args = {}, c.get("args", [])
    for i, a in enumerate(args):
        if a.startswith("--"):
            flag, eq, value = a[2:].partition("=")
            nxt = args[i + 1] if i + 1 < len(args) else ""
            out[flag] = value if eq else ("" if nxt.startswith("--") else nxt)
    return out


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_component_adds_the_decode_and_everything_validates(overlay, rendered_pd, kustomize):
    docs = rendered_pd[overlay]
    problems = [f"{name_of(d)}: {msg}" for d in docs for msg in validate_doc(d)]
    assert not problems, "\n".join(problems)
    kinds = sorted(d["kind"] for d in docs)
    base = [d["kind"] for d in kustomize(DEPLOY / "overlays" / overlay)]
    assert kinds == sorted(base + [*GATEWAY_KINDS, "Deployment"]), "the decode is all it adds"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pool_holds_both_roles_on_one_port(overlay: str, rendered, rendered_pd) -> None:
    docs = rendered_pd[overlay]
    pool = named(docs, "InferencePool", POOL)["spec"]
    labels = {
        n: pod(docs, n)["metadata"]["labels"] for n in (PREFILL, DECODE, "triton-prefill-epp")
    }
    selects = {
        n: pool["selector"]["matchLabels"].items() <= lab.items() for n, lab in labels.items()
    }
    assert selects == {PREFILL: True, DECODE: True, "triton-prefill-epp": False}
    assert (labels[PREFILL][ROLE], labels[DECODE][ROLE]) == ("prefill", "decode")
    # the picker reads vLLM's metric names on decode pods and ours on prefill pods
    assert labels[DECODE]["llm-d.ai/engine-type"] in epp_config.BUILTIN_ENGINES
    assert labels[PREFILL]["llm-d.ai/engine-type"] == "triton-prefill"
    # clients reach the prefill's PORT and the decode's sidecar on the pool's one target port
    sidecar = container(docs, DECODE, "routing-sidecar")
    prefill_port = int(effective_env(rendered[overlay]).get("PORT") or 8000)
    (target,) = [p["number"] for p in pool["targetPorts"]]
    assert target == prefill_port == port_of(sidecar, "http") == int(args_of(sidecar)["port"])
    # the sidecar forwards to vLLM, whose /metrics the picker scrapes where it scrapes ADMIN_PORT
    vllm = container(docs, DECODE, "vllm")
    scrape = epp_config.plugin(yaml.safe_load(PD_CONFIG.read_text()), "metrics-data-source")
    admin = int(effective_env(rendered[overlay]).get("ADMIN_PORT") or 8001)
    vllm_port = int(args_of(vllm)["port"])
    assert int(args_of(sidecar)["model-server-port"]) == vllm_port == port_of(vllm, "vllm")
    assert scrape["parameters"]["port"] == vllm_port == admin


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_picker_runs_the_pd_configuration(overlay: str, rendered_pd) -> None:
    docs = rendered_pd[overlay]
    spec = pod(docs, "triton-prefill-epp")["spec"]
    (volume,) = [v for v in spec["volumes"] if "configMap" in v]
    data = named(docs, "ConfigMap", volume["configMap"]["name"])["data"]
    assert data == {epp_config.EPP_CONFIG.name: PD_CONFIG.read_text()}


def test_pd_configuration_uses_registered_plugins() -> None:
    (config,) = load_yaml_docs(PD_CONFIG.read_text())
    assert epp_config.check_endpoint_picker_config(config) == []
    types = {p.get("name") or p["type"]: p["type"] for p in config["plugins"]}
    # PLUGIN_PARAMETERS: what v0.10.0's cmd/epp/runner registers, with each one's parameters
    assert set(types.values()) <= set(epp_config.PLUGIN_PARAMETERS) - DEPRECATED
    handler = epp_config.plugin(config, "disagg-profile-handler")["parameters"]
    assert types[handler["deciders"]["prefill"]] == "prefix-based-pd-decider"
    profiles = {
        p["name"]: [types[r["pluginRef"]] for r in p["plugins"]]
        for p in config["schedulingProfiles"]
    }
    assert set(profiles) == {handler["profiles"]["prefill"], handler["profiles"]["decode"]}
    assert "prefill-filter" in profiles[handler["profiles"]["prefill"]]
    assert "decode-filter" in profiles[handler["profiles"]["decode"]]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_prefill_settings_and_side_channel(overlay: str, rendered_pd) -> None:
    prefill = container(rendered_pd[overlay], PREFILL, "prefill")
    env = env_of(prefill)
    kv = {n for n in env if n.startswith("KV_")}
    assert {n.lower() for n in kv} <= set(Settings.model_fields), "names the service reads"
    assert env["KV_TRANSFER"]["value"] == "nixl"
    assert env["KV_TRANSFER_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert int(env["KV_TRANSFER_PORT"]["value"]) == port_of(prefill, "nixl-side")
    # the values reach Settings as valid settings
    Settings(**{n.lower(): env[n]["value"] for n in kv if "value" in env[n]})


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_decode_matches_the_hash_factors(overlay: str, rendered, rendered_pd) -> None:
    docs = rendered_pd[overlay]
    prefill = {n: e.get("value") for n, e in env_of(container(docs, PREFILL, "prefill")).items()}
    base = effective_env(rendered[overlay])
    vllm = container(docs, DECODE, "vllm")
    args = args_of(vllm)
    # same weights, same --model string (the hash's model factor), same model id
    assert args["model"] == prefill["KV_TRANSFER_DECODE_MODEL"] == base["MODEL_PATH"]
    served = base.get("SERVED_MODEL_NAME") or PurePosixPath(base["MODEL_PATH"]).name
    assert args["served-model-name"] == served
    assert vllm["image"] == f"vllm/vllm-openai:v{prefill['KV_TRANSFER_VLLM_VERSION']}"
    assert int(args["block-size"]) == int(base.get("PAGE_SIZE") or 16)
    kv_config = json.loads(args["kv-transfer-config"])
    assert kv_config == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_consumer",
        "kv_buffer_device": "cuda",
        "kv_load_failure_policy": "recompute",
    }
    assert args["attention-backend"] == prefill["KV_TRANSFER_DECODE_BACKEND"] == "FLASH_ATTN"
    # TP/PP/DCP and an FP8 KV cache are not supported by the producer
    assert not {
        "tensor-parallel-size",
        "pipeline-parallel-size",
        "decode-context-parallel-size",
        "kv-cache-dtype",
    } & set(args)
    env = env_of(vllm)
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "status.podIP"
    )
    assert int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"]) == port_of(vllm, "nixl-side")
    # the sidecar and the picker come from the same llm-d-router release
    image = container(docs, DECODE, "routing-sidecar")["image"]
    assert image == f"ghcr.io/llm-d/llm-d-router-disagg-sidecar:{epp_config.EPP_VERSION}"
