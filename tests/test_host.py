"""service.host: CPUs from the affinity mask and the cgroup quota; the CUDA driver requirement."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from service.config import load_settings, resolve
from service.host import cgroup_cpu_limit, cuda_requirement, driver_version, usable_cpus


def cgroup(tmp: Path, v2: str | None = None, v1: tuple[int, int] | None = None) -> Path:
    if v2 is not None:
        (tmp / "cpu.max").write_text(v2 + "\n")
    if v1 is not None:
        (tmp / "cpu").mkdir()
        (tmp / "cpu" / "cpu.cfs_quota_us").write_text(f"{v1[0]}\n")
        (tmp / "cpu" / "cpu.cfs_period_us").write_text(f"{v1[1]}\n")
    return tmp


@pytest.mark.parametrize("files,limit", [
    ({"v2": "150000 100000"}, 1.5),
    ({"v2": "max 100000"}, None),
    ({"v1": (50000, 100000)}, 0.5),
    ({"v1": (-1, 100000)}, None),
    ({}, None),
])
def test_cgroup_cpu_limit(tmp_path, files, limit) -> None:
    assert cgroup_cpu_limit(cgroup(tmp_path, **files)) == limit


def test_usable_cpus_is_the_affinity_mask_capped_by_the_quota(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    (tmp_path / "none").mkdir()
    assert usable_cpus(tmp_path / "none") == 8  # no quota
    assert usable_cpus(cgroup(tmp_path, v2="250000 100000")) == 2  # a 2.5-CPU limit
    (tmp_path / "cpu.max").write_text("50000 100000\n")
    assert usable_cpus(tmp_path) == 1  # never below one
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cpus(tmp_path) == 1


def test_cpu_threads_setting_overrides_and_auto_resolves() -> None:
    assert resolve(load_settings({"CPU_THREADS": "3"}), False)[0].cpu_threads == 3
    assert resolve(load_settings({}), False)[0].cpu_threads == usable_cpus()


def test_engine_applies_its_cpu_threads() -> None:
    from service.engine.core import EngineCore
    from tests.engine.helpers import engine_cfg, tiny_loaded

    before = torch.get_num_threads()
    try:
        EngineCore(engine_cfg(cpu_threads=1), loaded=tiny_loaded())
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_cuda_requirement_names_the_build_and_the_driver(tmp_path) -> None:
    msg = cuda_requirement("13.0", "570.124.06")
    assert "CUDA 13.0" in msg and "driver >= 580" in msg and "570.124.06" in msg
    version = tmp_path / "version"
    version.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.124.06  Thu Feb 20 "
                       "2025\nGCC version:  gcc version 12.3.0\n")
    assert driver_version(version) == "570.124.06"
    assert driver_version(tmp_path / "absent") is None
