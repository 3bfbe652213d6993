"""Import triton, or stand-ins that fail loudly at launch, so the `_ref` functions work without it.

Triton ships for Linux x86-64 only; a CPU-only install (e.g. a laptop) still serves through the
PyTorch references. Kernel modules import `triton`/`tl` from here instead of from triton directly.
"""

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
            if len(args) == 1 and callable(args[0]) and not kwargs:
                return self  # used as a decorator (@triton.jit)
            raise ImportError(
                "triton is not installed: the Triton kernels cannot run here. Install triton "
                "(Linux x86-64 with CUDA) or use the PyTorch references (use_triton=False)."
            )

        def __getitem__(self, grid):
            return self.__call__

    triton = tl = _Missing()


@triton.jit
def dot(a, b, acc, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """tl.dot(a, b, acc) for the kernels' matmuls (acc may be None).

    NOTE: Triton 3.6's interpreter multiplies bf16 bit patterns as integers in tl.dot, so on
    CPU the launchers set DOT_UPCAST: same bf16-rounded operands, multiplied in fp32."""
    if DOT_UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


def dot_flags(dtype, device_type: str) -> dict:
    """The DOT_PRECISION / DOT_UPCAST constexprs `dot` needs for this dtype and device."""
    import torch

    return dict(DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
                DOT_UPCAST=device_type == "cpu" and dtype == torch.bfloat16)


# Programmatic Dependent Launch (PDL, Hopper and later). A kernel launched with the CUDA attribute
# PROGRAMMATIC_STREAM_SERIALIZATION (Triton's `launch_pdl=True`) may have its programs scheduled
# while the previous kernel in the stream (or captured graph) still runs, hiding the launch gap
# between small kernels. Every kernel in kernels/ takes a `PDL` constexpr and, when it is set,
# starts with griddepcontrol.wait (`tl.extra.cuda.gdc_wait`), which blocks until the previous
# grid has completed and its writes are visible, then signals griddepcontrol.launch_dependents
# so that the next kernel can get scheduled in turn.
# NOTE: the constexpr and the launch attribute must travel together: a kernel launched early
# without the wait would read its inputs before the previous kernel wrote them. `pdl_flags`
# returns both or neither; the compile options carry launch_pdl into the compiled metadata that
# the launcher reads, and the JIT's cache key (options) and launch.py's (kwargs) both see them.
_PDL_ENABLED = True
_PDL_CAPABLE: dict[int, bool] = {}  # CUDA device index -> compute capability >= 9.0
# Under TRITON_INTERPRET every @triton.jit is an interpreted function (decided when the kernels
# are defined): the interpreter cannot run the PTX of the wait and drops launch_pdl unread.
_INTERPRETED = HAS_TRITON and not hasattr(dot, "device_caches")


def set_pdl(enabled: bool) -> None:
    """Turn PDL launches on or off for every kernel launched (or bound) from now on; a launch
    bound earlier (a Relauncher, a captured graph) keeps the flags it was bound with."""
    global _PDL_ENABLED
    _PDL_ENABLED = bool(enabled)


def pdl_enabled() -> bool:
    return _PDL_ENABLED


def pdl_flags(device) -> dict:
    """The launch kwargs for a kernel launched on `device`: PDL=True plus launch_pdl=True on a
    CUDA device of compute capability >= 9 while the switch is on; otherwise PDL=False alone
    (CPU, the interpreter, older GPUs)."""
    if not _PDL_ENABLED or _INTERPRETED or device.type != "cuda":
        return dict(PDL=False)
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    capable = _PDL_CAPABLE.get(index)
    if capable is None:
        capable = _PDL_CAPABLE[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return dict(PDL=True, launch_pdl=True) if capable else dict(PDL=False)


__all__ = ["HAS_TRITON", "dot", "dot_flags", "pdl_enabled", "pdl_flags", "set_pdl", "triton",
           "tl"]
