"""KV handoff over NIXL: stage() time (pool -> export region) and the read rate of a reader agent.

A Llama-3.1-8B-shaped pool (32 layers, 8 kv heads, head_dim 128, bf16, 16-token pages) holds one
prompt (random KV) on scattered pages; stage() copies it into the export region, which a NixlAgent
registers (VRAM on a GPU); a second agent in the same process reads every (layer, page) block over
UCX with one descriptor each, as vLLM's decode does, with a done notification.

Usage: python bench/kv_transfer.py                # GPU, 8k-token prompt
       python bench/kv_transfer.py --dry-run      # small shapes on the CPU (DRAM)
Needs nixl (pip install '.[kv-transfer]'). Writes kv-transfer.json and .md to $OUT.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import markdown_table, out_dir, run_meta, write_results  # noqa: E402
from service.kv_transfer.agent import NixlAgent  # noqa: E402
from service.kv_transfer.export import ExportRegion  # noqa: E402
from service.model.config import ModelConfig  # noqa: E402

PAGE = 16


def llama8b(layers: int) -> ModelConfig:
    return ModelConfig(arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_layers=layers, num_heads=32, num_kv_heads=8, head_dim=128)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_stage(region: ExportRegion, pool: torch.Tensor, pages: list[int], device: str,
               repeats: int) -> tuple[list[int], float]:
    times = []
    for _ in range(repeats + 2):  # 2 warm-ups
        sync(device)
        t0 = time.perf_counter()
        ids = region.stage(pool, pages)
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
        region.free(ids)
    return region.stage(pool, pages), statistics.median(times[2:])


def time_reads(region: ExportRegion, agent: NixlAgent, ids: list[int], mem: str, repeats: int):
    """Median seconds of one read of every (layer, page) block, and whether the bytes match."""
    from nixl._api import nixl_agent, nixl_agent_config

    reader = nixl_agent("bench-reader", nixl_agent_config(backends=["UCX"], num_threads=4))
    L, bl = region.data.shape[0], region.block_len
    buf = torch.empty(L, len(ids), region.data[0, 0].numel(), dtype=region.data.dtype,
                      device=region.data.device)
    reader.register_memory(buf)
    remote = reader.add_remote_agent(agent.metadata())
    local = reader.get_xfer_descs([(buf[i, j].data_ptr(), bl, 0) for i in range(L)
                                   for j in range(len(ids))], mem)
    far = reader.get_xfer_descs([(region.base_addrs[i] + e * bl, bl, 0) for i in range(L)
                                 for e in ids], mem)
    xfer = reader.initialize_xfer("READ", local, far, remote, b"bench:1")
    times = []
    for _ in range(repeats + 1):  # 1 warm-up (connection set-up)
        t0 = time.perf_counter()
        state = reader.transfer(xfer)
        while state == "PROC":
            state = reader.check_xfer_state(xfer)
        assert state == "DONE", f"read ended in {state}"
        times.append(time.perf_counter() - t0)
    reader.release_xfer_handle(xfer)
    same = torch.equal(buf, region.data[:, ids].flatten(2))
    return statistics.median(times[1:]), same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--dry-run", action="store_true", help="256 tokens, 4 layers, CPU DRAM")
    args = ap.parse_args()
    device = "cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"
    mem = "VRAM" if device == "cuda" else "DRAM"
    tokens, layers = (256, 4) if args.dry_run else (args.tokens, args.layers)
    cfg, n = llama8b(layers), -(-tokens // PAGE)
    pool_pages = 2 * n + 1
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(2, layers, pool_pages * PAGE, 8, 128, generator=gen).to(device,
                                                                             torch.bfloat16)
    pages = (torch.randperm(pool_pages - 1, generator=gen)[:n] + 1).tolist()
    region = ExportRegion(cfg, n + 1, PAGE, torch.bfloat16, device)
    ids, stage_ms = time_stage(region, pool, pages, device, args.repeats)
    t0 = time.perf_counter()
    agent = NixlAgent("bench-prefill", region, mem)
    register_ms = (time.perf_counter() - t0) * 1e3
    read_s, same = time_reads(region, agent, ids, mem, args.repeats)
    for _ in range(200):  # notifications ride on each read
        if agent.notifications():
            break
        time.sleep(0.01)
    else:
        raise SystemExit("no done notification arrived")
    agent.close()
    nbytes = layers * n * region.block_len
    row = {"device": device, "mem": mem, "tokens": tokens, "layers": layers, "pages": n,
           "bytes": nbytes, "descriptors": layers * n, "stage_ms": stage_ms,
           "stage_GBps": 2 * nbytes / stage_ms / 1e6, "register_ms": register_ms,
           "read_ms": read_s * 1e3, "read_GBps": nbytes / read_s / 1e9, "bytes_equal": same}
    header = list(row)
    md = markdown_table(header, [[row[k] for k in header]])
    write_results(out_dir(), "kv-transfer", run_meta(), {"results": [row]}, md)
    print(md)
    if not same:
        raise SystemExit("the reader's bytes differ from the export region")


if __name__ == "__main__":
    main()
