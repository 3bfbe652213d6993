"""bench/engine_memory.py --trace: every process of the service traces its allocations and, on
SIGUSR2, writes a tracemalloc snapshot and its live objects by type to $EM_TRACE_DIR. Tracing
starts at the first SIGUSR2: what start-up allocates is not traced (and not slowed)."""

import os

if os.environ.get("EM_TRACE_DIR"):
    import ctypes
    import gc
    import json
    import signal
    import tracemalloc
    from collections import Counter

    _dumps = [0]

    def _mallinfo() -> dict:
        class Info(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks",
                        "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

        try:
            fn = ctypes.CDLL("libc.so.6").mallinfo2
        except (OSError, AttributeError):
            return {}
        fn.restype = Info
        info = fn()
        return {n: getattr(info, n) for n, _ in Info._fields_}

    def _malloc_info(path: str) -> None:
        """glibc's XML report of every malloc arena (one per thread that allocated)."""
        libc = ctypes.CDLL("libc.so.6")
        libc.fopen.restype = ctypes.c_void_p
        fp = libc.fopen(path.encode(), b"w")
        libc.malloc_info(0, ctypes.c_void_p(fp))
        libc.fclose(ctypes.c_void_p(fp))

    def _dump(*_) -> None:
        out = f"{os.environ['EM_TRACE_DIR']}/{os.getpid()}-{_dumps[0]:03d}"
        _dumps[0] += 1
        _malloc_info(out + ".malloc.xml")
        if tracemalloc.is_tracing():
            tracemalloc.take_snapshot().dump(out + ".snap")
        else:
            tracemalloc.start(8)
        types = Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.get_objects())
        with open(out + ".json", "w") as f:
            json.dump({"traced": tracemalloc.get_traced_memory(), "gc_count": gc.get_count(),
                       "gc_stats": gc.get_stats(),
                       "frozen": gc.get_freeze_count(), "mallinfo2": _mallinfo(),
                       "types": dict(types.most_common(300))}, f)

    signal.signal(signal.SIGUSR2, _dump)
