"""The Hopper (Gluon) attention kernel compiles for sm_90 without a GPU: Triton's frontend, its
TTGIR passes and the bundled ptxas, for each head_dim and grid order the service can launch, so
a syntax, type or layout error shows here and not first on an H200. (What it computes is
checked on the GPU: tests/kernels/test_kernels_gpu.py.) Each compile runs in a child process
without TRITON_INTERPRET, which turns Gluon functions into interpreted ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CASES = [(128, 3, True), (128, 2, False), (64, 5, True)]  # head_dim, stages, heads_first


def compile_kernel(head_dim: int, stages: int, heads_first: bool) -> dict:
    """Compile `_attention_kernel` for sm_90; its cubin size and shared memory."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from kernels import extend_attention_sm90 as sm90

    fn = sm90._attention_kernel
    tile = sm90.CONSUMERS * sm90.BLOCK_M
    layout = gl.NVMMASharedLayout.get_default_for([tile, head_dim], gl.bfloat16)
    desc = f"tensordesc<bf16[{tile}, {head_dim}],{layout!r}>"
    types = {"q_desc": desc, "k_desc": desc, "v_desc": desc, "o_ptr": "*bf16",
             "cu_seqlens_q_ptr": "*i32", "qk_scale": "fp32"}  # the rest: int32 scalars
    values = {"HEAD_DIM": head_dim, "BLOCK_M": sm90.BLOCK_M, "STAGES": stages,
              "HEADS_FIRST": heads_first, "CONSUMER_REGS": sm90.CONSUMER_REGS}
    names = fn.arg_names
    signature = {n: types.get(n, "constexpr" if n in values else "i32") for n in names}
    constexprs = {(names.index(n),): v for n, v in values.items()}
    kernel = triton.compile(GluonASTSource(fn, signature, constexprs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    return {"cubin_bytes": len(kernel.asm["cubin"]), "shared": kernel.metadata.shared}


@pytest.mark.parametrize("head_dim, stages, heads_first", CASES)
def test_hopper_kernel_compiles_for_sm90(head_dim, stages, heads_first):
    sm90 = pytest.importorskip("kernels.extend_attention_sm90")
    if not sm90.HAS_GLUON:
        pytest.skip("this Triton has no Gluon")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, __file__, str(head_dim), str(stages),
                           str(int(heads_first))], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["cubin_bytes"] > 0
    assert got["shared"] <= 232448, f"{got['shared']} B: more shared memory than an sm_90 SM has"


if __name__ == "__main__":
    d, s, hf = (int(a) for a in sys.argv[1:4])
    print(json.dumps(compile_kernel(d, s, bool(hf))))
