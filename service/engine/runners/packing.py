"""A batch's small tensors in one int64 buffer (segments `align`-byte aligned): ONE copy."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


def _up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclass(frozen=True)
class Packing:
    offsets64: tuple[int, ...]  # int64 words from the start
    sizes64: tuple[int, ...]
    base32: int  # the word where the int32 segments start
    offsets32: tuple[int, ...]  # int32 elements from base32
    sizes32: tuple[int, ...]
    words: int

    @classmethod
    def of(cls, sizes64: Sequence[int], sizes32: Sequence[int], align: int = 16) -> Packing:
        a64, a32 = align // 8, align // 4
        at, off64 = 0, []
        for n in sizes64:
            off64.append(at)
            at = _up(at + n, a64)
        base32, at, off32 = at, 0, []
        for n in sizes32:
            off32.append(at)
            at = _up(at + n, a32)
        return cls(tuple(off64), tuple(sizes64), base32, tuple(off32), tuple(sizes32),
                   base32 + -(-at // 2))

    def cut(self, words: torch.Tensor | np.ndarray) -> tuple:
        """The segments as views of int64 `words` (torch or numpy), int64 ones first."""
        i32 = words[self.base32:].view(np.int32 if isinstance(words, np.ndarray) else torch.int32)
        return (*(words[o:o + n] for o, n in zip(self.offsets64, self.sizes64)),
                *(i32[o:o + n] for o, n in zip(self.offsets32, self.sizes32)))

    def words_to(self, segment32: int, elems: int) -> int:
        """Words through the first `elems` of int32 segment `segment32`."""
        return self.base32 + -(-(self.offsets32[segment32] + elems) // 2)
