"""Graph backends: dense steps captured per shape into ONE shared pool, attention run between."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from service.model.decoder import Eager

Step = tuple[str, Any]  # ("graph", CUDAGraph) | ("dense", fn) | ("attention", layer)
Attend = Callable[[int], None]


class _Recording:
    def __init__(self, backend: SegmentBackend, key: Hashable, attend: Attend):
        self.backend, self.key, self.attend = backend, key, attend
        self.steps: list[Step] = []

    def dense(self, fn: Callable[[], None]) -> None:
        self.steps.append(self.backend._capture_dense(fn, self.key))

    def attention(self, layer: int) -> None:
        self.attend(layer)  # NOTE: between captures, as at replay
        self.steps.append(("attention", layer))


def tensor_bytes(obj: Any, seen: set[int] | None = None) -> int:
    """Bytes of the distinct tensor storages reachable from obj, in 512 B CUDA blocks."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        st = obj.untyped_storage()
        if st.data_ptr() in seen:
            return 0
        seen.add(st.data_ptr())
        if st.device.type == "cuda":
            return -(-st.nbytes() // 512) * 512
        return st.nbytes()
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(x, seen) for x in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(x, seen) for x in obj.values())
    if hasattr(obj, "__dataclass_fields__"):
        return sum(tensor_bytes(getattr(obj, f), seen) for f in obj.__dataclass_fields__)
    return 0


class SegmentBackend:
    def __init__(self) -> None:
        self._steps: dict[Hashable, list[Step]] = {}
        self._whole: set[Hashable] = set()
        self._retained: dict[Hashable, Any] = {}
        self.capture_seconds = 0.0

    def _capture_dense(self, fn: Callable[[], None], key: Hashable) -> Step:
        return ("dense", fn)

    def _context(self) -> AbstractContextManager:
        return nullcontext()

    def _release(self) -> None:
        pass

    def capture(self, key: Hashable, run: Callable[[Any], None], attend: Attend,
                keep: Any = None) -> None:
        assert key not in self._steps, f"shape {key!r} captured twice"
        t0 = time.perf_counter()
        with self._context():
            run(Eager(attend))
            rec = _Recording(self, key, attend)
            run(rec)
        self._steps[key] = rec.steps
        if keep is not None:
            self._retained[key] = keep
        self.capture_seconds += time.perf_counter() - t0

    def capture_whole(self, key: Hashable, fn: Callable[[], None]) -> None:
        """`fn` as ONE graph: everything it touches must be a fixed buffer."""
        assert key not in self._steps, f"shape {key!r} captured twice"
        t0 = time.perf_counter()
        with self._context():
            fn()
            self._steps[key] = [self._capture_dense(fn, key)]
        self._whole.add(key)
        self.capture_seconds += time.perf_counter() - t0

    def replay(self, key: Hashable, attend: Attend | None = None) -> None:
        """A whole graph runs on the caller's stream; a breakable one on the backend's."""
        steps = self._steps[key]
        if key in self._whole:
            self._run(steps[0])
            return
        with self._context():
            for step in steps:
                if step[0] == "attention":
                    attend(step[1])
                else:
                    self._run(step)

    @staticmethod
    def _run(step: Step) -> None:
        if step[0] == "graph":
            step[1].replay()
        else:
            step[1]()

    def has(self, key: Hashable) -> bool:
        return key in self._steps

    @property
    def keys(self) -> tuple[Hashable, ...]:
        return tuple(self._steps)

    @property
    def num_graphs(self) -> int:
        return sum(kind == "graph" for steps in self._steps.values() for kind, _ in steps)

    def num_steps(self, key: Hashable) -> tuple[int, int]:
        """(dense steps, attention steps) of one shape."""
        attention = sum(kind == "attention" for kind, _ in self._steps[key])
        return len(self._steps[key]) - attention, attention

    def retained(self, key: Hashable) -> Any:
        return self._retained.get(key)

    def retained_bytes(self) -> int:
        seen: set[int] = set()
        return sum(tensor_bytes(x, seen) for x in self._retained.values())

    def close(self) -> None:
        self._release()
        self._steps.clear()
        self._whole.clear()
        self._retained.clear()


class CudaGraphBackend(SegmentBackend):
    """Dense steps as CUDA graphs in one pool; all on `stream` (one cuBLAS workspace)."""

    def __init__(self, stream: torch.cuda.Stream):
        super().__init__()
        self.stream = stream
        self._pool = torch.cuda.graph_pool_handle()

    def _capture_dense(self, fn: Callable[[], None], key: Hashable) -> Step:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool, stream=self.stream):
            fn()
        return ("graph", g)

    def _context(self) -> AbstractContextManager:
        return torch.cuda.stream(self.stream)

    def _release(self) -> None:
        self.stream.synchronize()
        for steps in self._steps.values():
            for kind, g in steps:
                if kind == "graph":
                    g.reset()
        self._pool = None
