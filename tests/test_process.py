"""Process set-up: the frozen start-up heap leaves automatic garbage collection working."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# A start-up heap of 400k objects (the engine's is ~325k), then request-like reference cycles
# that each outlive a few collections, as a Request and its Prompts do, before they die
CYCLES = """
import collections
from service.process import freeze_heap

heap = [[] for _ in range(400_000)]
freeze_heap()
freed = 0

class Node:
    __slots__ = ("peer",)

    def __del__(self):
        global freed
        freed += 1

window = collections.deque()
for _ in range(60_000):
    a, b = Node(), Node()
    a.peer, b.peer = b, a
    window.append(a)
    if len(window) > 2_000:
        window.popleft()
print(2 * (60_000 - len(window)) - freed)
"""


def test_cycles_made_after_freeze_heap_are_collected():
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", CYCLES], cwd=repo, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    dead = int(out)
    assert dead < 116_000 // 4, f"{dead} of 116,000 dead objects still wait for a collection"
