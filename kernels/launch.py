"""Relaunch compiled Triton kernels with only the tensors at `swap` replaced, skipping the JIT's
per-call binding and hashing; `CACHE`, keyed by plain values, is the one launch cache."""

from __future__ import annotations

import copy
from collections import OrderedDict
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
    """No launch hook installed (Triton 3.6 keeps an empty HookChain, never None)."""
    hook = knobs.runtime.launch_enter_hook
    return hook is None or not getattr(hook, "calls", True)


class LaunchCache:
    """A bounded LRU map; it answers nothing while a launch hook is installed."""

    def __init__(self, size: int = 256):
        self.size = size
        self._entries: OrderedDict[tuple, Any] = OrderedDict()

    def get(self, key: tuple | None) -> Any:
        if key is None or not hooks_idle():
            return None
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def put(self, key: tuple | None, value: Any) -> None:
        if key is None:
            return
        self._entries[key] = value
        self._entries.move_to_end(key)
        if len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()


CACHE = LaunchCache()


def call_key(name: str, bound: Sequence[torch.Tensor], swapped: Sequence[torch.Tensor],
             *scalars: Any) -> tuple:
    """A bound launch's inputs: bound tensors' addresses, swapped ones' alignment, all layouts."""
    key = [name, bound[0].device, *scalars]
    for t in bound:
        key += (t.data_ptr(), t.dtype, t.shape, t.stride())
    for t in swapped:
        key += (t.data_ptr() % 16, t.dtype, t.shape, t.stride())
    return tuple(key)


def spec_key(fn: Any, device: torch.device, args: list, kwargs: dict) -> tuple | None:
    """A key at least as fine as Triton's specialization; None (the JIT decides) otherwise."""
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
        else:
            return None
    key.append(tuple(sorted(kwargs.items())))
    return tuple(key)


class Relauncher:
    """`fn[grid](*args)`, args at `swap` replaced per call (same dtype, 16-byte alignment)."""

    def __init__(self, fn: Any, grid: tuple[int, ...], args: Sequence[Any],
                 kwargs: dict[str, Any], swap: Sequence[int], wrap: Callable | None = None):
        self.fn, self.grid, self.kwargs = fn, tuple(grid) + (1,) * (3 - len(grid)), kwargs
        self.args, self.swap, self.wrap = list(args), tuple(swap), wrap
        self.device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        self._compiled = wrap is None and hasattr(fn, "device_caches")  # False: always the JIT
        self._bound: tuple | None = None

    def detach(self) -> bool:
        """Keep addresses, not tensors (no caller memory held); False where nothing is compiled."""
        if self._bound is None:
            return False
        handles, vals, aligned = self._bound
        vals = [_detached(v) for v in vals]
        self._bound, self.args = (handles, vals, aligned), None
        return True

    def __call__(self, *tensors: torch.Tensor) -> None:
        assert len(tensors) == len(self.swap), f"{len(tensors)} tensors for {len(self.swap)} slots"
        if self._bound is not None and hooks_idle():
            handles, vals, aligned = self._bound
            for i, t in zip(self.swap, tensors):
                assert t.dtype == aligned[i][0] and (t.data_ptr() % 16 == 0) == aligned[i][1], (
                    "swapped tensor differs in dtype or alignment from the compiled one")
                vals[i] = t
            self._launch(handles, vals)
            for i in self.swap:  # hold no caller tensor between launches
                vals[i] = None
            return
        if self.args is None:
            raise RuntimeError("a detached launcher cannot launch while a launch hook is set")
        args = list(self.args)
        for i, t in zip(self.swap, tensors):
            args[i] = t
        key = spec_key(self.fn, self.device, args, self.kwargs) if self._compiled else None
        handles = CACHE.get(key)
        if handles is not None:  # compiled for an earlier launch that specializes alike
            self._launch(handles, self._values(args))
        else:
            fn = self.wrap(self.fn) if self.wrap is not None else self.fn
            compiled = fn[self.grid](*args, **self.kwargs)
            handles = _handles(compiled) if self._compiled else None
            if handles is None:
                return
            CACHE.put(key, handles)
        if self._bound is None:
            aligned = {i: (args[i].dtype, args[i].data_ptr() % 16 == 0) for i in self.swap}
            vals = [None if i in self.swap else v for i, v in enumerate(self._values(args))]
            self._bound = (handles, vals, aligned)

    def _launch(self, handles: tuple, vals: list) -> None:
        launcher, function, packed = handles
        stream = driver.active.get_current_stream(self.device.index)
        launcher(*self.grid, stream, function, packed, None, None, None, *vals)

    def _values(self, args: list) -> list:
        """Every parameter's value in signature order, as the JIT hands them to the launcher."""
        rest = self.fn.params[len(args):]
        return args + [self.kwargs.get(p.name, p.default) for p in rest]


def _handles(compiled: Any) -> tuple | None:
    """(launcher, function, packed metadata) of the compiled kernel the JIT returned, or None."""
    compiled = compiled.result() if hasattr(compiled, "result") else compiled
    if compiled is None or not hasattr(compiled, "packed_metadata"):
        return None
    return compiled.run, compiled.function, compiled.packed_metadata


class _Address:
    """An address standing in for a tensor (launchers read `data_ptr()` and dtype only)."""

    __slots__ = ("dtype", "ptr")

    def __init__(self, ptr: int, dtype: torch.dtype):
        self.ptr, self.dtype = ptr, dtype

    def data_ptr(self) -> int:
        return self.ptr


def _detached(v: Any) -> Any:
    """A tensor as its address; a TMA descriptor as a copy over an `_Address`."""
    if isinstance(v, torch.Tensor):
        return v.data_ptr()
    base = getattr(v, "base", None)
    if isinstance(base, torch.Tensor):
        v = copy.copy(v)
        v.base = _Address(base.data_ptr(), base.dtype)
    return v
