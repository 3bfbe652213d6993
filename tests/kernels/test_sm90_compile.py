"""The Hopper (Gluon) attention kernel compiles for sm_90 without a GPU: Triton's frontend, its
TTGIR passes and the bundled ptxas, for each head_dim and grid order the service can launch, with
and without the fused KV store, as the JIT specializes it, so a syntax, type or layout error
shows here and not first on an H200; and ptxas keeps no stack frame, since a spill's local
memory is out of range inside a warp-specialized partition (an H200 faults). (What it computes
is checked on the GPU: tests/kernels/test_kernels_gpu.py.) Each compile runs in a child process
without TRITON_INTERPRET, which turns Gluon functions into interpreted ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CASES = [(128, "{}"), (128, '{"stages": 2, "heads_first": false}'), (64, '{"stages": 5}'),
         (128, '{"ctas": 0}'), (64, '{"stages": 5, "ctas": 0}'),  # CTAs looping over tiles
         (128, '{"ctas": 0, "stages": 2, "q_slots": 2}'), (64, '{"ctas": 0, "q_slots": 2}')]
# with the KV store fused (the service fuses it at D64, where its only pick is the 2-slot loop;
# the kernel takes it in every config): one CTA per tile, looping, 2 Q slots
STORES = [(d, json.dumps({**json.loads(c), "store_kv": True}))
          for d, c in (CASES[0], CASES[3], *CASES[-2:])]
COMPILES = CASES + STORES
# what the JIT marks as multiples of 16 in every launch: 16-byte aligned pointers (supported()
# asks it of q/k/v/out; caches, slots and cu_seqlens are whole or leading allocations) and the
# row strides (multiples of head_dim); the kernel specializes no count
ALIGNED = ("o_ptr", "k_cache_ptr", "v_cache_ptr", "slot_ptr", "cu_seqlens_q_ptr", "stride_ot",
           "stride_kcs", "stride_vcs")


def compile_kernel(head_dim: int, config: str) -> dict:
    """Compile `_attention_kernel` for sm_90 as the JIT does (`config`: Sm90Config fields as
    JSON, and "store_kv"); its cubin size, shared memory and stack bytes (None without the
    bundled cuobjdump)."""
    import tempfile

    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from kernels import extend_attention_sm90 as sm90
    from kernels import extend_attention_sm90_kernel as sm90k

    fn = sm90k._attention_kernel
    tile = sm90k.CONSUMERS * sm90k.BLOCK_M
    layout = gl.NVMMASharedLayout.get_default_for([tile, head_dim], gl.bfloat16)
    desc = f"tensordesc<bf16[{tile}, {head_dim}],{layout!r}>"
    types = {"q_desc": desc, "k_desc": desc, "v_desc": desc, "o_ptr": "*bf16",
             "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "slot_ptr": "*i64",
             "cu_seqlens_q_ptr": "*i32", "qk_scale": "fp32"}  # the rest: int32 scalars
    fields = json.loads(config)
    store_kv = fields.pop("store_kv", False)
    values = sm90.launch_meta(head_dim, sm90.Sm90Config(**fields), store_kv)
    options = {"num_warps": values.pop("num_warps")}
    names = fn.arg_names
    signature = {n: types.get(n, "constexpr" if n in values else "i32") for n in names}
    constexprs = {(names.index(n),): v for n, v in values.items()}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ALIGNED}
    kernel = triton.compile(GluonASTSource(fn, signature, constexprs, attrs),
                            target=GPUTarget("cuda", 90, 32), options=options)
    cuobjdump = getattr(knobs.nvidia.cuobjdump, "path", None)
    stack = None
    if cuobjdump and os.path.exists(cuobjdump):
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name],
                                   capture_output=True, text=True, check=True).stdout
        stack = int(usage.split("STACK:")[1].split()[0])
    return {"cubin_bytes": len(kernel.asm["cubin"]), "shared": kernel.metadata.shared,
            "stack": stack}


@pytest.mark.parametrize("head_dim, config", COMPILES)
def test_hopper_kernel_compiles_for_sm90(head_dim, config):
    from kernels import extend_attention_sm90 as sm90

    if not sm90.HAS_GLUON:
        pytest.skip("this Triton has no Gluon")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, __file__, str(head_dim), config],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["cubin_bytes"] > 0
    assert got["shared"] <= 232448, f"{got['shared']} B: more shared memory than an sm_90 SM has"
    assert got["stack"] in (0, None), f"{got['stack']} B of stack: ptxas spilled"


if __name__ == "__main__":
    print(json.dumps(compile_kernel(int(sys.argv[1]), sys.argv[2])))
