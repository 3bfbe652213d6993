"""What the GPU overlays deploy: the model from a read-only volume, a rollout deadline that covers
a cold start, and only settings the service serves."""

from __future__ import annotations

import posixpath
import re

import pytest
from deploy_testlib import DEPLOY, OVERLAYS, REPO, container, effective_env, one

# Seconds allowed for pulling the multi-GB image onto a fresh node, on top of the start-up budget.
IMAGE_PULL_ALLOWANCE_S = 300
# Where `kubectl rollout status ... --timeout=` is documented.
ROLLOUT_DOCS = ("docs/deploying.md",)


def weights_mounts(docs: list[dict]) -> list[tuple[dict, dict]]:
    """(volumeMount, volume) pairs of the container's PersistentVolumeClaim mounts."""
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    claims = {v["name"]: v for v in pod.get("volumes", []) if "persistentVolumeClaim" in v}
    return [(m, claims[m["name"]]) for m in container(docs)["volumeMounts"] if m["name"] in claims]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_model_comes_from_a_read_only_volume(overlay: str, rendered) -> None:
    docs = rendered[overlay]
    mounts = weights_mounts(docs)
    assert len(mounts) == 1, f"{overlay}: expected one weights volume, got {mounts}"
    mount, volume = mounts[0]
    assert mount.get("readOnly") is True, "the serving pods must not write the weights"
    assert volume["persistentVolumeClaim"].get("readOnly") is True
    assert volume["persistentVolumeClaim"].get("claimName")
    model_path = effective_env(docs).get("MODEL_PATH")
    assert model_path, f"{overlay} serves the embedded 135M model: set MODEL_PATH"
    root = mount["mountPath"].rstrip("/") + "/"
    assert posixpath.normpath(model_path).startswith(root), (
        f"MODEL_PATH={model_path} is not inside the weights mount {mount['mountPath']}"
    )


def startup_budget_s(probe: dict) -> int:
    return probe.get("initialDelaySeconds", 0) + probe.get("periodSeconds", 10) * probe.get(
        "failureThreshold", 3
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_progress_deadline_covers_pull_and_start_up(overlay: str, rendered) -> None:
    docs = rendered[overlay]
    deadline = one(docs, "Deployment")["spec"].get("progressDeadlineSeconds", 600)
    budget = startup_budget_s(container(docs)["startupProbe"])
    assert deadline > budget + IMAGE_PULL_ALLOWANCE_S, (
        f"progressDeadlineSeconds {deadline} <= startupProbe budget {budget} s "
        f"+ {IMAGE_PULL_ALLOWANCE_S} s image pull: a cold rollout is reported as failed"
    )


def duration_s(text: str) -> int:
    """kubectl's --timeout durations: 20m, 1200s, 1h5m."""
    units = {"h": 3600, "m": 60, "s": 1}
    parts = re.findall(r"(\d+)([hms])", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"cannot parse duration {text!r}"
    return sum(int(n) * units[u] for n, u in parts)


@pytest.mark.parametrize("doc", ROLLOUT_DOCS)
def test_documented_rollout_timeout_waits_for_the_deadline(doc: str, rendered) -> None:
    deadlines = [
        one(rendered[o], "Deployment")["spec"].get("progressDeadlineSeconds", 600) for o in OVERLAYS
    ]
    timeouts = re.findall(r"rollout status\b.*?--timeout[= ](\S+)", (REPO / doc).read_text())
    assert timeouts, f"{doc} shows no `kubectl rollout status --timeout=...`"
    for t in timeouts:
        assert duration_s(t) >= max(deadlines), (
            f"{doc}: rollout status --timeout={t} gives up before progressDeadlineSeconds "
            f"{max(deadlines)}"
        )


def test_no_manifest_sets_dp_size(rendered) -> None:
    """The HTTP service refuses DP_SIZE > 1 and serves 1 by default: the key only invites edits
    that stop every pod."""
    for path in sorted(DEPLOY.rglob("*.yaml")):
        text = "\n".join(
            line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")
        )
        assert not re.search(r"\bDP_SIZE\b", text), f"{path.relative_to(REPO)} sets DP_SIZE"
    for overlay, docs in rendered.items():
        assert "DP_SIZE" not in effective_env(docs), f"{overlay} renders DP_SIZE"
