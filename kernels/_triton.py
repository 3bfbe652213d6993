"""triton and tl, or stand-ins that fail at launch: without Triton the `_ref` functions serve."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAS_TRITON = False

    class _Missing:
        """Stands in for triton/tl: decorates silently, raises when anything is launched."""

        def __getattr__(self, name: str) -> _Missing:
            return self

        def __call__(self, *args, **kwargs):
            if (len(args) == 1 and callable(args[0]) and not kwargs) or (kwargs and not args):
                return self  # used as a decorator (@triton.jit, @triton.jit(...))
            raise ImportError(
                "triton is not installed: the Triton kernels cannot run here. Install triton "
                "(Linux x86-64 with CUDA) or use the PyTorch references (use_triton=False)."
            )

        def __getitem__(self, grid):
            return self.__call__

    triton = tl = _Missing()



@triton.jit
def dot(a, b, acc, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """tl.dot; DOT_UPCAST in fp32 (Triton 3.6's interpreter multiplies bf16 bit patterns)."""
    if DOT_UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


def dot_flags(dtype, device_type: str) -> dict:
    """The DOT_PRECISION / DOT_UPCAST constexprs `dot` needs for this dtype and device."""
    import torch

    return dict(DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
                DOT_UPCAST=device_type == "cpu" and dtype == torch.bfloat16)


__all__ = ["HAS_TRITON", "dot", "dot_flags", "triton", "tl"]
