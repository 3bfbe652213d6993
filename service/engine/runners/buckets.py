"""CUDA-graph buckets: the token-count ladder (SGLang's), padding, and when to run eagerly."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

# (upper bound, step) of each stretch of the default ladder; then _TAIL_STEP up to the cap
_LADDER = ((32, 4), (256, 16), (512, 32), (1024, 64), (4096, 256))
_TAIL_STEP = 512


def default_ladder(max_tokens: int) -> tuple[int, ...]:
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
    """A sorted ladder; n tokens replay `pad_to_bucket(n)` unless that more than doubles n."""

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
        i = bisect.bisect_left(self.sizes, n)
        return self.sizes[i] if i < len(self.sizes) else None

    def use_graph(self, n: int) -> bool:
        bucket = self.pad_to_bucket(n)
        return n > 0 and bucket is not None and bucket <= 2 * n

    def capture_order(self) -> tuple[int, ...]:
        """Largest first: smaller captures reuse the shared pool's freed blocks."""
        return tuple(reversed(self.sizes))
