"""The KEDA component scales like the HPA it replaces, on this deployment's queue alone."""

from __future__ import annotations

import re

import pytest
from deploy_testlib import OVERLAYS, one, scrape_job


def prometheus_trigger(spec: dict) -> dict:
    """The metadata of the ScaledObject's one Prometheus trigger."""
    triggers = [t for t in spec["triggers"] if t["type"] == "prometheus"]
    assert len(triggers) == 1, spec["triggers"]
    return triggers[0]["metadata"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_scaled_object_copies_the_hpa(overlay: str, rendered, rendered_with_keda) -> None:
    hpa = one(rendered[overlay], "HorizontalPodAutoscaler")["spec"]
    scaled = one(rendered_with_keda[overlay], "ScaledObject")["spec"]
    assert scaled.get("minReplicaCount") == hpa.get("minReplicas", 1)
    assert scaled.get("maxReplicaCount") == hpa["maxReplicas"]
    behavior = scaled.get("advanced", {}).get("horizontalPodAutoscalerConfig", {}).get("behavior")
    assert behavior == hpa["behavior"], "KEDA's HPA must scale up and down like the base HPA"
    (target,) = [m["pods"]["target"] for m in hpa["metrics"] if m["type"] == "Pods"]
    assert prometheus_trigger(scaled)["threshold"] == str(target["averageValue"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_query_counts_only_this_deployment(overlay: str, rendered_with_keda) -> None:
    docs = rendered_with_keda[overlay]
    query = prometheus_trigger(one(docs, "ScaledObject")["spec"])["query"]
    (selector,) = re.findall(r"prefill_queue_requests\{([^}]*)\}", query)
    labels = dict(re.findall(r'(\w+)\s*=\s*"([^"]*)"', selector))
    # The HPA's Pods metric is per namespace by construction; the query must say so itself.
    assert labels.get("namespace"), f'no namespace="..." in {query}'
    assert labels.get("job") == scrape_job(docs), query
