"""CUDA-graph buckets: the token-count ladder, padding to a bucket, and when a batch runs eagerly.

The default ladder follows SGLang's prefill ladder: step 4 up to 32, 16 up to 256, 32 up to 512,
64 up to 1024, 256 up to 4096, 512 beyond. It is capped at min(CUDA_GRAPH_MAX_TOKENS,
MAX_PREFILL_TOKENS), and the cap itself becomes the last bucket so the largest batch can replay.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

# (upper bound, step) of each stretch of the default ladder; the last step repeats to the cap.
_LADDER = ((32, 4), (256, 16), (512, 32), (1024, 64), (4096, 256))
_TAIL_STEP = 512


def default_ladder(max_tokens: int) -> tuple[int, ...]:
    """SGLang-like ladder up to `max_tokens` (inclusive), with `max_tokens` as the last bucket."""
    if max_tokens <= 0:
        return ()
    out: list[int] = []
    start = 0
    for bound, step in _LADDER:
        out.extend(range(start + step, bound + 1, step))
        start = bound
    last = out[-1]
    while last + _TAIL_STEP <= max_tokens:
        last += _TAIL_STEP
        out.append(last)
    kept = [b for b in out if b <= max_tokens]
    if not kept or kept[-1] != max_tokens:
        kept.append(max_tokens)
    return tuple(kept)


def resolve_buckets(explicit: tuple[int, ...] | None, cuda_graph_max_tokens: int,
                    max_prefill_tokens: int) -> tuple[int, ...]:
    """The sorted bucket list: `explicit` (CUDA_GRAPH_BUCKETS) or the default ladder, capped."""
    cap = min(cuda_graph_max_tokens, max_prefill_tokens)
    if cap <= 0:
        return ()
    if explicit is None:
        return default_ladder(cap)
    return tuple(sorted({b for b in explicit if 0 < b <= cap}))


@dataclass(frozen=True)
class Buckets:
    """A sorted ladder. A batch of n tokens replays bucket `pad_to_bucket(n)` when `use_graph(n)`.

    Eager when n exceeds the largest bucket, or when the bucket would more than double n
    (e.g. buckets (4, 16): 5 tokens → eager since 16 > 2·5; 8 tokens → graph, 16 ≤ 2·8).
    """

    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        assert list(self.sizes) == sorted(set(self.sizes)), f"buckets must be sorted: {self.sizes}"
        assert all(b > 0 for b in self.sizes), f"buckets must be positive: {self.sizes}"

    @property
    def largest(self) -> int:
        return self.sizes[-1] if self.sizes else 0

    def __len__(self) -> int:
        return len(self.sizes)

    def __iter__(self):
        return iter(self.sizes)

    def pad_to_bucket(self, n: int) -> int | None:
        """Smallest bucket ≥ n, or None when n exceeds the largest."""
        i = bisect.bisect_left(self.sizes, n)
        return self.sizes[i] if i < len(self.sizes) else None

    def use_graph(self, n: int) -> bool:
        bucket = self.pad_to_bucket(n)
        return n > 0 and bucket is not None and bucket <= 2 * n

    def capture_order(self) -> tuple[int, ...]:
        """Largest first: later (smaller) captures carve the shared pool's freed blocks."""
        return tuple(reversed(self.sizes))
