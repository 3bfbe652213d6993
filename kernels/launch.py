"""Relaunch one compiled Triton kernel with a few tensors swapped, skipping the JIT's per-call work.

`kernel[grid](*args)` re-binds and re-specializes every argument, hashes a cache key and looks
the compiled kernel up on every call: 30-50 us of host time per launch on the H200's host
(bench/launch_overhead.py), more than the GPU needs for a break's kernels on a small batch.
A break launches the same kernel once per layer and only the KV-cache pointers change, so
`Relauncher` goes through the JIT once (it compiles or loads the kernel and hands back the
CompiledKernel), keeps the bound argument list, and from then on calls the compiled kernel's
launcher directly with the new tensors in place.

The compiled kernel is specialized on each pointer's 16-byte alignment, so a swapped tensor
must share the first one's dtype and alignment (checked per call; a KV pool's layers are all
aligned alike). Under TRITON_INTERPRET=1 (no compiled kernels), with `wrap` (tracing) and while
a launch hook is installed (profilers), every call takes the JIT path.

Across batches the first launch need not take the JIT either: compiled kernels are remembered
under a key at least as fine as Triton's own specialization (per int: 32/64-bit range, == 1,
divisible by 16; per tensor: dtype and 16-byte alignment; every constexpr by value), so a new
batch whose arguments specialize alike reuses the launcher at once. Arguments Triton treats in
other ways (tensor descriptors) make the key None: the JIT decides.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kernels._triton import HAS_TRITON

if HAS_TRITON:
    from triton import knobs
    from triton.runtime.driver import driver
else:  # pragma: no cover - the JIT path raises its own clear error at launch
    knobs = driver = None


def hooks_idle() -> bool:
    """No launch hook installed. NOTE: Triton 3.6 keeps the hooks in an (empty) HookChain that
    is never None; an empty chain means no hook, as None did before."""
    hook = knobs.runtime.launch_enter_hook
    return hook is None or not getattr(hook, "calls", True)


class Relauncher:
    """`fn[grid](*args, **kwargs)` with the positional args at `swap` replaced per call."""

    def __init__(self, fn: Any, grid: tuple[int, ...], args: Sequence[Any],
                 kwargs: dict[str, Any], swap: Sequence[int], wrap: Callable | None = None):
        self.fn, self.grid, self.kwargs = fn, tuple(grid) + (1,) * (3 - len(grid)), kwargs
        self.args, self.swap = list(args), tuple(swap)
        self.wrap = wrap
        # (launcher, function, packed metadata, bound values, {swap index: (dtype, aligned)})
        self._fast: tuple | None = None
        self._can_fast = wrap is None and hasattr(fn, "device_caches")
        # the launch device: the first tensor argument's (swap may be empty)
        self.device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)

    def detach(self) -> bool:
        """Forget the bound tensors outside the swapped slots, keeping only their raw pointers,
        so that holding this launcher keeps no caller memory alive. From then on only the fast
        path can launch: callers must check `hooks_idle()` first. False (nothing changed) where
        there is no fast path (interpreter, `wrap`, a launch hook at the first call)."""
        if self._fast is None:
            return False
        launcher, function, packed, vals, aligned = self._fast
        vals = [v if i in self.swap else _detached(v) for i, v in enumerate(vals)]
        self._fast, self.args = (launcher, function, packed, vals, aligned), None
        return True

    def __call__(self, *tensors: torch.Tensor) -> None:
        assert len(tensors) == len(self.swap), f"{len(tensors)} tensors for {len(self.swap)} slots"
        if self.args is None and not hooks_idle():
            raise RuntimeError("a detached launcher cannot launch while a launch hook is set")
        if self._fast is not None and hooks_idle():
            launcher, function, packed, vals, aligned = self._fast
            for i, t in zip(self.swap, tensors):
                assert t.dtype == aligned[i][0] and (t.data_ptr() % 16 == 0) == aligned[i][1], (
                    "swapped tensor differs in dtype or alignment from the compiled one")
                vals[i] = t
            stream = driver.active.get_current_stream(self.device.index)
            launcher(*self.grid, stream, function, packed, None, None, None, *vals)
            return
        args = list(self.args)
        for i, t in zip(self.swap, tensors):
            args[i] = t
        key = _spec_key(self.fn, self.device, args, self.kwargs) if self._can_fast else None
        known = _COMPILED.get(key) if key is not None and hooks_idle() else None
        if known is None:
            fn = self.wrap(self.fn) if self.wrap is not None else self.fn
            compiled = fn[self.grid](*args, **self.kwargs)
            known = _handles(compiled) if self._can_fast else None
            if known is None:
                return
            if key is not None:
                _COMPILED[key] = known
        else:  # compiled for an earlier batch that specializes alike: no JIT at all
            launcher, function, packed = known
            stream = driver.active.get_current_stream(self.device.index)
            launcher(*self.grid, stream, function, packed, None, None, None,
                     *self._values(args))
        if self._fast is None:
            aligned = {i: (args[i].dtype, args[i].data_ptr() % 16 == 0) for i in self.swap}
            self._fast = (*known, self._values(args), aligned)

    def _values(self, args: list) -> list:
        """Every parameter's value in signature order, constexprs and defaults included (what
        Triton's JIT hands the launcher): positional args fill the first parameters."""
        rest = self.fn.params[len(args):]
        return args + [self.kwargs.get(p.name, p.default) for p in rest]


class _Address:
    """A device address standing in for a tensor where a launcher reads only `data_ptr()` (and
    a tensor descriptor, its base's dtype): Triton's launchers take either for a pointer."""

    __slots__ = ("dtype", "ptr")

    def __init__(self, ptr: int, dtype: torch.dtype):
        self.ptr, self.dtype = ptr, dtype

    def data_ptr(self) -> int:
        return self.ptr


def _detached(v: Any) -> Any:
    """A launch argument without references to tensors: a tensor becomes its address; a TMA
    descriptor (Triton's or Gluon's host TensorDescriptor) a copy over an `_Address`."""
    if isinstance(v, torch.Tensor):
        return v.data_ptr()
    base = getattr(v, "base", None)
    if isinstance(base, torch.Tensor):
        v = copy.copy(v)
        v.base = _Address(base.data_ptr(), base.dtype)
    return v


class LastLaunch:
    """The last prepared launch of a one-call entry point, reused while the caller repeats it.

    A one-call entry point checks, binds and specializes its arguments on every call; repeated
    with the same tensors (a benchmark loop, an eager layer loop over the same buffers) all of
    that is the same work again. `lookup` hands the stored launch back when the call's key
    (shapes, strides, scalars: everything the binding depends on) is unchanged and every listed
    tensor is the very object bound last time, at the same address. It holds weak references
    and raw pointers only (see `Relauncher.detach`), so it keeps no caller memory alive.
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._refs: tuple = ()
        self._ptrs: tuple[int, ...] = ()
        self._value: Any = None

    def lookup(self, key: tuple, tensors: Sequence[torch.Tensor]) -> Any:
        if key != self._key or not hooks_idle():
            return None
        for ref, ptr, t in zip(self._refs, self._ptrs, tensors):
            if ref() is not t or t.data_ptr() != ptr:
                return None
        return self._value

    def store(self, key: tuple, tensors: Sequence[torch.Tensor], value: Any) -> None:
        self._key, self._value = key, value
        self._refs = tuple(weakref.ref(t) for t in tensors)
        self._ptrs = tuple(t.data_ptr() for t in tensors)


# (fn, device, specialization key) -> (launcher, function, packed metadata)
_COMPILED: dict[tuple, tuple] = {}


def _handles(compiled: Any) -> tuple | None:
    """The launcher of a compiled kernel the JIT returned; None where there is none."""
    compiled = compiled.result() if hasattr(compiled, "result") else compiled
    if compiled is None or not hasattr(compiled, "packed_metadata"):
        return None
    return compiled.run, compiled.function, compiled.packed_metadata


def _spec_key(fn: Any, device: torch.device, args: list, kwargs: dict) -> tuple | None:
    """A key at least as fine as Triton's specialization of these arguments, or None."""
    key: list = [id(fn), device.type, device.index]
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((a.dtype, a.data_ptr() % 16 == 0))
        elif isinstance(a, bool) or a is None:
            key.append(a)
        elif isinstance(a, int):
            key.append((a == 1, a % 16 == 0, -(2**31) <= a < 2**31, a < 2**63))
        elif isinstance(a, float):
            key.append(float)
        else:  # tensor descriptors and anything else: let the JIT specialize
            return None
    key.append(tuple(sorted(kwargs.items())))
    return tuple(key)
