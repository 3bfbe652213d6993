"""A prompt's end: the hook a consumer plugs in, and leases that keep its pages past the answer.

A lease holds pages as a running prompt does (never evicted) until released or expired."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from service.engine.interface import ForwardFailed, PromptResult

if TYPE_CHECKING:
    from service.engine.batching import Batch
    from service.engine.core import EngineCore, ForwardOutput
    from service.engine.prefix_cache import PrefixCache
    from service.engine.prompt import Prompt

log = logging.getLogger(__name__)
Finished = tuple["Prompt", PromptResult | None, BaseException | None]

Keep = Callable[[float], "Lease"]  # seconds -> a lease on the finished prompt's pages


class FinishHook:
    """A consumer of finished prompts; every method runs on the engine thread but `stats`."""

    def start(self, engine: EngineCore) -> None:
        """The engine is loaded and not yet ready; raising fails the load."""

    def wants_hidden(self, prompt: Prompt) -> bool:
        """At submit (under the scheduler's lock): `prompt`'s last hidden row reaches on_finish."""
        return False

    def on_finish(self, prompt: Prompt, result: PromptResult, hidden: torch.Tensor | None,
                  keep: Keep) -> PromptResult | None:
        """The prompt's last chunk has run: the result to answer (None: `result` as it is)."""
        return None

    def stats(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        """The engine stops."""


class Lease:
    """Pages kept past their prompt's answer; `release()` is safe from any thread, idempotent."""

    def __init__(self, leases: Leases, pages: list[int], tokens: int, expires_at: float):
        self.pages, self.tokens, self.expires_at = pages, tokens, expires_at
        self._leases = leases

    def release(self) -> None:
        self._leases.release(self)


class Leases:
    """Every lease held; `take`/`reap`/`drop_all` on the engine thread, `release` from any."""

    def __init__(self, hold: Callable[[list[int]], None], free: Callable[[list[int]], None],
                 wake: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic):
        self._hold, self._free, self._wake, self.clock = hold, free, wake, clock
        self._lock = threading.Lock()
        self._held: dict[int, Lease] = {}
        self._released: list[Lease] = []
        self.expired = 0

    def take(self, pages: list[int], tokens: int, seconds: float) -> Lease:
        assert seconds > 0, f"a lease needs a positive duration, got {seconds}"
        self._hold(pages)
        lease = Lease(self, list(pages), tokens, self.clock() + seconds)
        with self._lock:
            self._held[id(lease)] = lease
        return lease

    def release(self, lease: Lease) -> None:
        with self._lock:
            if self._held.pop(id(lease), None) is None:
                return
            self._released.append(lease)
        self._wake()

    def reap(self) -> None:
        if not self._held and not self._released:
            return
        now = self.clock()
        with self._lock:
            done, self._released = self._released, []
            late = [k for k, v in self._held.items() if v.expires_at <= now]
            done += [self._held.pop(k) for k in late]
            self.expired += len(late)
        for lease in done:
            self._free(lease.pages)

    def drop_all(self) -> None:
        with self._lock:
            self._released += self._held.values()
            self._held.clear()
        self.reap()

    def wait_s(self) -> float | None:
        """Seconds until the next expiry (None: no lease)."""
        with self._lock:
            soonest = min((v.expires_at for v in self._held.values()), default=None)
        return None if soonest is None else max(soonest - self.clock(), 0.0)

    @property
    def pages(self) -> int:
        with self._lock:
            return sum(len(v.pages) for v in self._held.values())

    @property
    def tokens(self) -> int:
        with self._lock:
            return sum(v.tokens for v in self._held.values())


def absorb_batch(batch: Batch, out: ForwardOutput, cache: PrefixCache, hook: FinishHook | None,
                 leases: Leases) -> list[Finished]:
    """Each chunk's forward into its prompt; a prompt whose last chunk ran goes to the hook."""
    finished: list[Finished] = []
    for i, ((r, c), logits, summary) in enumerate(zip(batch, out.logits, out.last)):
        if r.cancelled:
            finished.append((r, None, None))
            continue
        try:
            cache.insert(r.keys or [], r.pages, c.prefix_len + c.num_tokens)
            res = r.absorb(c, logits, summary, out.hidden.get(i), out.pooled.get(i),
                           out.scores.get(i))
            if res is not None and hook is not None:
                res = hook.on_finish(r, res, out.hidden.get(i),
                                     lambda s, r=r: leases.take(r.pages, r.num_tokens, s)) or res
        except Exception as e:  # noqa: BLE001 - a sampling or hook bug fails this prompt only
            log.exception("post-processing failed")
            finished.append((r, None, ForwardFailed(f"{type(e).__name__}: {e}")))
            continue
        if res is not None:
            finished.append((r, res, None))
    return finished
