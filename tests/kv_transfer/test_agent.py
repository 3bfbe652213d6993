"""The NIXL agent: a second in-process agent reads staged export pages over loopback UCX and
notifies us, as vLLM's decode does; without nixl, a clear install hint."""

from __future__ import annotations

import importlib.util
import sys
import time

import pytest
import torch

from service.kv_transfer.agent import NixlAgent, NixlUnavailable
from service.kv_transfer.export import ExportRegion
from tests.kv_transfer.test_export import PS, cfg, random_pool

HAS_NIXL = importlib.util.find_spec("nixl") is not None
needs_nixl = pytest.mark.skipif(not HAS_NIXL, reason="nixl is not installed")


def wait_for(poll, what: str, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if got := poll():
            return got
        time.sleep(0.01)
    raise AssertionError(f"no {what} within {timeout_s} s")


def pull(region: ExportRegion, agent: NixlAgent, layers: list[int], ids: list[int],
         mem: str, dev: int) -> torch.Tensor:
    """Read pages `ids` of `layers` into a reader agent's own buffer, as the decode does."""
    from nixl._api import nixl_agent, nixl_agent_config

    reader = nixl_agent("reader", nixl_agent_config(backends=["UCX"]))
    buf = torch.zeros(len(layers), len(ids), region.data[0, 0].numel(),
                      dtype=region.data.dtype, device=region.data.device)
    reg = reader.register_memory(buf)
    remote = reader.add_remote_agent(agent.metadata())
    bl = region.block_len
    local = reader.get_xfer_descs([(buf[i, j].data_ptr(), bl, dev) for i in range(len(layers))
                                   for j in range(len(ids))], mem)
    far = reader.get_xfer_descs([(region.base_addrs[layer] + e * bl, bl, dev)
                                 for layer in layers for e in ids], mem)
    xfer = reader.initialize_xfer("READ", local, far, remote, b"req-1:1")
    assert reader.transfer(xfer) != "ERR"
    wait_for(lambda: reader.check_xfer_state(xfer) == "DONE", "finished read")
    reader.release_xfer_handle(xfer)
    reader.deregister_memory(reg)
    reader.remove_remote_agent(remote)
    return buf


def loopback(device: str, mem: str) -> None:
    c = cfg(layers=3, kv_heads=2, head_dim=8)
    pool = random_pool(c, 10).to(device)
    region = ExportRegion(c, 8, PS, torch.float32, device)
    ids = region.stage(pool, [9, 2, 6, 4])
    agent = NixlAgent("prefill-test", region, mem, device_id=max(region.data.get_device(), 0))
    try:
        assert agent.notifications() == []
        want = [ids[1], ids[3]]
        got = pull(region, agent, [0, 2], want, mem, max(region.data.get_device(), 0))
        assert torch.equal(got, region.data[[0, 2]][:, want].flatten(2))
        assert wait_for(agent.notifications, "notification") == [b"req-1:1"]
    finally:
        agent.close()


@needs_nixl
def test_reader_pulls_staged_pages_over_loopback():
    loopback("cpu", "DRAM")


@pytest.mark.gpu
@needs_nixl
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_reader_pulls_vram_pages_over_loopback():
    loopback("cuda", "VRAM")


def test_missing_nixl_names_the_extra(monkeypatch):
    for name in ("nixl", "nixl._api"):  # None in sys.modules: importing it raises ImportError
        monkeypatch.setitem(sys.modules, name, None)
    region = ExportRegion(cfg(), 2, PS, torch.float32, "cpu")
    with pytest.raises(NixlUnavailable, match=r"pip install '\.\[kv-transfer\]'"):
        NixlAgent("prefill-test", region, "DRAM")


def test_mem_type_must_match_the_region():
    region = ExportRegion(cfg(), 2, PS, torch.float32, "cpu")
    with pytest.raises(ValueError, match="mem_type"):
        NixlAgent("prefill-test", region, "VRAM")
    with pytest.raises(ValueError, match="mem_type"):
        NixlAgent("prefill-test", region, "HBM")
