"""Breakable CUDA graphs: dense segments captured per shape, eager breaks replayed between them.

`run_once(rec)` describes one forward as `rec.dense(fn)` (captured) and `rec.brk(fn)` (run
eagerly at replay: attention + KV store, whose launch grid depends on the live batch).
`rec.dense(fn, share="key")` marks steps that are the same graph: the first is captured, the
later ones of that shape replay it again (the layer-indexed middle segments, whose weights are
picked by a device counter: service.model.stacked). A break
function must read the live batch through a handle the caller sets before `replay` — never from
a closure over the capture batch, or that batch stays alive for as long as the graphs do.

`capture_one(shape_key, run_once, capture_inputs=None, post_warmup_hook=None)` warms up (one
eager pass), calls the hook, then captures each dense step as its own CUDA graph into ONE pool
shared by every shape (SGLang's BreakableCudaGraphBackend, mini-sglang's graph.py).
`capture_inputs` is retained per shape only when given: the caller passes just the capture-only
tensors whose addresses the graphs recorded (the data-parallel gather counts), or None.

`SegmentBackend` is the device-free base (it "captures" a dense step by keeping the function),
which the CPU tests drive; `CudaGraphBackend` overrides the two hooks that touch CUDA.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

log = logging.getLogger(__name__)

Step = tuple[str, Any]  # ("graph", CUDAGraph) | ("dense", fn) | ("break", fn)


class _Direct:
    """Recorder for the warm-up pass: everything runs eagerly."""

    @staticmethod
    def dense(fn: Callable[[], None], share: Hashable | None = None) -> None:
        fn()

    @staticmethod
    def brk(fn: Callable[[], None]) -> None:
        fn()


class _Capturing:
    """Recorder for the capture pass: dense steps become graphs, breaks run and are kept."""

    def __init__(self, backend: SegmentBackend, shape_key: Hashable, steps: list[Step]):
        self.backend, self.shape_key, self.steps = backend, shape_key, steps
        self.shared: dict[Hashable, Step] = {}

    def dense(self, fn: Callable[[], None], share: Hashable | None = None) -> None:
        if share is not None and share in self.shared:
            self.steps.append(self.shared[share])  # the same graph, replayed again
            return
        step = self.backend._capture_dense(fn, self.shape_key)
        if share is not None:
            self.shared[share] = step
        self.steps.append(step)

    def brk(self, fn: Callable[[], None]) -> None:
        fn()  # NOTE: runs between captures (not inside one), as at replay
        self.steps.append(("break", fn))


def tensor_bytes(obj: Any, seen: set[int] | None = None) -> int:
    """Bytes of the distinct tensor storages reachable from obj (dataclasses, tuples, dicts),
    as the CUDA allocator holds them (rounded up to its 512 B blocks)."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        st = obj.untyped_storage()
        if st.data_ptr() in seen:
            return 0
        seen.add(st.data_ptr())
        if st.device.type == "cuda":  # the caching allocator's smallest block is 512 B
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
    """Device-free breakable backend: 'capturing' keeps the function; replay calls it."""

    def __init__(self) -> None:
        self._steps: dict[Hashable, list[Step]] = {}
        self._retained: dict[Hashable, Any] = {}
        self.capture_seconds = 0.0

    # -- hooks a device backend overrides -------------------------------------------------------
    def _capture_dense(self, fn: Callable[[], None], shape_key: Hashable) -> Step:
        return ("dense", fn)

    def _context(self) -> AbstractContextManager:
        return nullcontext()

    def _release(self) -> None:
        pass

    # -- public ---------------------------------------------------------------------------------
    def capture_one(self, shape_key: Hashable, run_once: Callable[[Any], None],
                    capture_inputs: Any = None,
                    post_warmup_hook: Callable[[], None] | None = None,
                    whole: bool = False) -> None:
        """`whole`: breaks and dense steps alike go into ONE graph (the breaks must then read
        nothing but fixed buffers: service.engine.full_graph)."""
        assert shape_key not in self._steps, f"shape {shape_key!r} captured twice"
        t0 = time.perf_counter()
        with self._context():
            run_once(_Direct())  # warm-up: compiles/loads kernels, fixes cuBLAS choices
            if post_warmup_hook is not None:
                post_warmup_hook()
            steps: list[Step] = []
            if whole:
                steps.append(self._capture_dense(lambda: run_once(_Direct()), shape_key))
            else:
                run_once(_Capturing(self, shape_key, steps))
        self._steps[shape_key] = steps
        if capture_inputs is not None:
            self._retained[shape_key] = capture_inputs
        self.capture_seconds += time.perf_counter() - t0

    def replay(self, shape_key: Hashable) -> None:
        """A whole graph (capture_one(whole=True)) is launched on the caller's current stream;
        a breakable one's steps run on the backend's stream."""
        steps = self._steps[shape_key]
        if len(steps) == 1 and steps[0][0] == "graph":
            steps[0][1].replay()
            return
        with self._context():
            for kind, step in steps:
                if kind == "graph":
                    step.replay()
                else:
                    step()

    def has(self, shape_key: Hashable) -> bool:
        return shape_key in self._steps

    @property
    def shape_keys(self) -> tuple[Hashable, ...]:
        """In capture order."""
        return tuple(self._steps)

    @property
    def num_graphs(self) -> int:
        """Distinct captured graphs (a shared step counts once)."""
        return len({id(g) for steps in self._steps.values() for kind, g in steps
                    if kind == "graph"})

    def num_steps(self, shape_key: Hashable) -> tuple[int, int]:
        """(dense steps, breaks) of one shape; a shared step counts at every replay."""
        breaks = sum(kind == "break" for kind, _ in self._steps[shape_key])
        return len(self._steps[shape_key]) - breaks, breaks

    def retained(self, shape_key: Hashable) -> Any:
        return self._retained.get(shape_key)

    def retained_bytes(self) -> int:
        """Bytes of capture inputs kept alive after capture (distinct storages)."""
        seen: set[int] = set()
        return sum(tensor_bytes(x, seen) for x in self._retained.values())

    def close(self) -> None:
        self._release()
        self._steps.clear()
        self._retained.clear()


class CudaGraphBackend(SegmentBackend):
    """Dense steps as CUDA graphs in one shared pool; warm-up, capture and replay on `stream`.

    One stream for all three (and for the engine's eager work) means one cuBLAS workspace and
    no per-segment stream objects. `shared_pool=False` (benchmarks only) gives every shape its
    own pool, to measure what sharing saves.
    """

    def __init__(self, stream: torch.cuda.Stream, shared_pool: bool = True):
        super().__init__()
        self.stream = stream
        self.shared_pool = shared_pool
        self._pool = torch.cuda.graph_pool_handle() if shared_pool else None
        self._pools: dict[Hashable, Any] = {}

    def _capture_dense(self, fn: Callable[[], None], shape_key: Hashable) -> Step:
        pool = self._pool
        if pool is None:
            pool = self._pools.setdefault(shape_key, torch.cuda.graph_pool_handle())
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool, stream=self.stream):
            fn()
        return ("graph", g)

    def _context(self) -> AbstractContextManager:
        return torch.cuda.stream(self.stream)

    def _release(self) -> None:
        self.stream.synchronize()
        graphs = {id(g): g for steps in self._steps.values() for kind, g in steps
                  if kind == "graph"}
        for g in graphs.values():
            g.reset()
        self._pool = None
        self._pools.clear()
