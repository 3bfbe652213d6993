"""The engine's queue length in a shared file: workers answer 429 without asking the engine."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np

_FIELDS = 2  # prompts waiting, Retry-After seconds


class QueueBoard:
    def __init__(self, path: str | Path, create: bool = False):
        if create:
            Path(path).write_bytes(bytes(8 * _FIELDS))
        with open(path, "r+b") as f:
            self._mm = mmap.mmap(f.fileno(), 8 * _FIELDS)
        self._v = np.ndarray((_FIELDS,), np.int64, buffer=self._mm)

    def write(self, queue: int, retry_after_s: int) -> None:
        self._v[1] = retry_after_s
        self._v[0] = queue

    def read(self) -> tuple[int, int]:
        return int(self._v[0]), int(self._v[1])

    def close(self) -> None:
        del self._v
        self._mm.close()
