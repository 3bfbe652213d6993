"""What the host gives this process: the CPUs it may use, and the driver its torch build needs."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
NVIDIA_VERSION_FILE = Path("/proc/driver/nvidia/version")
# Oldest Linux driver of each CUDA major release (CUDA toolkit release notes)
MIN_DRIVER = {13: 580, 12: 525, 11: 450}


def cgroup_cpu_limit(root: Path = CGROUP_ROOT) -> float | None:
    """CPUs allowed by the cgroup CPU quota (a Kubernetes CPU limit), or None without one."""
    v2 = root / "cpu.max"  # cgroup v2: "<quota> <period>" or "max <period>"
    v1 = (root / "cpu" / "cpu.cfs_quota_us", root / "cpu" / "cpu.cfs_period_us")
    try:
        if v2.is_file():
            quota, period = v2.read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        if v1[0].is_file() and v1[1].is_file():
            quota, period = int(v1[0].read_text()), int(v1[1].read_text())
            return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None
    return None


def usable_cpus(root: Path = CGROUP_ROOT) -> int:
    """Whole CPUs this process may use: its affinity mask, capped by the floored cgroup quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    limit = cgroup_cpu_limit(root)
    if limit is not None:
        cpus = min(cpus, math.floor(limit))
    return max(cpus, 1)


def describe_cpus(root: Path = CGROUP_ROOT) -> str:
    try:
        mask = f"{len(os.sched_getaffinity(0))} CPUs in the affinity mask"
    except AttributeError:
        mask = f"{os.cpu_count()} CPUs"
    limit = cgroup_cpu_limit(root)
    return mask + (f", cgroup CPU quota {limit:g}" if limit is not None else ", no CPU quota")


def driver_version(path: Path = NVIDIA_VERSION_FILE) -> str | None:
    """The loaded NVIDIA kernel driver's version (e.g. "570.124.06"), or None without one."""
    try:
        m = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+\.\d+(?:\.\d+)?)", path.read_text())
    except OSError:
        return None
    return m.group(1) if m else None


def cuda_requirement(torch_cuda: str | None = None, driver: str | None = None) -> str:
    """Why CUDA may be unusable here: the build's CUDA version, the driver needed and found."""
    if torch_cuda is None:
        import torch

        torch_cuda, build = torch.version.cuda, torch.__version__
    else:
        build = f"cu{torch_cuda}"
    if torch_cuda is None:
        return f"This torch build ({build}) has no CUDA support"
    driver = driver or driver_version()
    need = MIN_DRIVER.get(int(torch_cuda.split(".")[0]))
    found = f"the driver here is {driver}" if driver else "no NVIDIA driver was found"
    needs = f", which needs an NVIDIA driver >= {need}" if need else ""
    return f"This torch build ({build}) uses CUDA {torch_cuda}{needs}; {found}"


def api_workers(setting: int) -> int:
    """API_WORKERS, or from the CPU count where it is 0."""
    return setting or auto_api_workers(usable_cpus())


def auto_api_workers(cpus: int) -> int:
    """Two CPUs for the engine, two per worker, at most eight: beyond, one engine is the limit."""
    return max(1, min(8, (cpus - 2) // 2))
