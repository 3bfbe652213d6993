"""Compile every Triton kernel of kernels/ for sm_90 without a GPU and report its PDL facts.

Run as a script in a process WITHOUT TRITON_INTERPRET (under the interpreter even tl.sum is an
interpreted function and nothing compiles); tests/kernels/test_pdl.py does that. Each launcher is
called on small CPU tensors with `wrap` set to a recorder, so the arguments are the launcher's
own; the recorder checks that the launcher passed the `PDL` constexpr, then compiles the kernel
for GPUTarget("cuda", 90) with PDL (the constexpr and `launch_pdl`) on and off. Triton's bundled
ptxas assembles the PTX too. Prints one JSON object: {kernel: {"on"|"off": facts}}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernels import activation, kv_store, linear, logits_summary, rope  # noqa: E402
from kernels import extend_attention as attn  # noqa: E402
from kernels import rms_norm as norm  # noqa: E402

_PTR = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32",
        torch.float64: "*fp64", torch.int32: "*i32", torch.int64: "*i64"}
_OPTIONS = ("num_warps", "num_stages", "launch_pdl")
REPORT: dict[str, dict] = {}


def _facts(compiled) -> dict:
    ptx = compiled.asm["ptx"]
    loads = [i for i in (ptx.find("ld.global"), ptx.find("cp.async")) if i >= 0]
    return dict(launch_pdl=bool(compiled.metadata.launch_pdl),
                wait=ptx.find("griddepcontrol.wait"),
                dependents=ptx.find("griddepcontrol.launch_dependents"),
                first_load=min(loads) if loads else -1, cubin=len(compiled.asm.get("cubin", b"")))


class _Recorder:
    """Stands in for `kernel[grid]`: compiles the kernel for sm_90 with the launcher's args."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return self._launch

    def _launch(self, *args, **kwargs):
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        assert kwargs.get("PDL") is False, f"{self.fn.__name__}: launcher passed no PDL=False"
        names = self.fn.arg_names
        sig, consts = {}, {}
        for name, value in zip(names, args):
            if isinstance(value, torch.Tensor):
                sig[name] = _PTR[value.dtype]
            elif value is None:
                sig[name], consts[name] = "constexpr", None
            elif isinstance(value, int):
                sig[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            else:
                assert isinstance(value, float), f"{name}: {type(value)}"
                sig[name] = "fp32"
        for name in names[len(args):]:
            sig[name], consts[name] = "constexpr", kwargs[name]
        options = {k: v for k, v in kwargs.items() if k in _OPTIONS}
        facts = {}
        for on in (True, False):
            consts["PDL"] = on
            src = ASTSource(fn=self.fn, signature=dict(sig), constexprs=dict(consts))
            compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                      options=dict(options, launch_pdl=on))
            facts["on" if on else "off"] = _facts(compiled)
        REPORT[self.fn.__name__] = facts


def main() -> None:
    bf = torch.bfloat16
    w = _Recorder
    x = torch.randn(5, 96, dtype=bf)
    norm.fused_add_rms_norm(x, x.clone(), torch.ones(4, 96, dtype=bf), 1e-6,
                            layer=torch.zeros(1, dtype=torch.int32), wrap=w)
    q, k = torch.randn(5, 4, 64, dtype=bf), torch.randn(5, 2, 64, dtype=bf)
    positions = torch.arange(5, dtype=torch.int32)
    rope.apply_rope(q, k, positions, rope.rope_cos_sin_cache(64, 16, 1e4), wrap=w)
    activation.silu_and_mul(torch.randn(5, 192, dtype=bf), wrap=w)
    cache = torch.zeros(64, 2, 64, dtype=bf)
    kv_store.store_kv(k, k, cache, cache, positions, wrap=w)
    linear.indexed_linear(x, torch.randn(3, 32, 96, dtype=bf), None,
                          torch.zeros(1, dtype=torch.int32), wrap=w)
    logits_summary.logits_summary(torch.randn(2, 5000, dtype=bf), 4,
                                  torch.empty(2, 10, dtype=torch.float64), wrap=w)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    attn.extend_attention(q, k, k, cache, cache, cu, torch.tensor([3, 0], dtype=torch.int32),
                          torch.tensor([[1], [0]], dtype=torch.int32), 16, 3, wrap=w)
    print(json.dumps(REPORT))


if __name__ == "__main__":
    main()
