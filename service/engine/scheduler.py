"""The engine loop: one thread owns the engine; others only `submit`/`cancel`/`abort`, locked.

On a GPU forward n + 1 launches before forward n is read; the one stream orders their pages."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from service.engine.batching import Batch, form_batch
from service.engine.chunk_size import ChunkSizer
from service.engine.finish import FinishHook, Leases, absorb_batch
from service.engine.finish_rate import FinishRate
from service.engine.interface import (
    SHUTTING_DOWN,
    EngineInfo,
    EngineStats,
    ForwardFailed,
    KVPoolExhausted,
    NotReady,
    admission_error,
)
from service.engine.pages import pages_for
from service.engine.prefix_cache import PrefixCache
from service.engine.prompt import NullObserver, Observer, Prompt

log = logging.getLogger(__name__)

InFlight = tuple[Batch, Any]
OnLoaded = Callable[[BaseException | None], None]
# Called under the lock whenever the queue changes: (prompts waiting, Retry-After seconds)
OnQueue = Callable[[int, int], None]
# The engine thread's input, never under the lock: handle what waits, waiting up to `timeout` s
Poll = Callable[[float], None]
POLL_IDLE_S = 0.1  # an idle engine thread polling its input sees stop() this soon


class Scheduler:
    def __init__(self, engine_factory: Callable[[], Any], *, max_queue: int,
                 max_batch_prompts: int, max_logit_rows: int = 2048,
                 prefix_cache: bool = True, observer: Observer | None = None,
                 on_queue: OnQueue | None = None, poll: Poll | None = None,
                 finish_hook: FinishHook | None = None):
        """With `poll`, the engine thread takes its own input (no GIL hand-over per message)."""
        self._factory, self._on_queue, self._poll = engine_factory, on_queue, poll
        self.max_queue, self.max_batch_prompts = max_queue, max_batch_prompts
        assert max_logit_rows >= 1, f"max_logit_rows must be >= 1, got {max_logit_rows}"
        self.max_logit_rows = max_logit_rows
        self.observer = observer or NullObserver()
        self.launching_since = 0.0  # when the engine thread entered a launch; 0 outside one
        self.prefix_cache_enabled = prefix_cache
        self.cache: PrefixCache | None = None  # built with the engine (it needs the allocator)
        self.hook = finish_hook
        self.leases: Leases | None = None
        self._sizer: ChunkSizer | None = None  # where a launch runs a whole forward
        self._cv = threading.Condition()
        self._waiting: deque[Prompt] = deque()
        self._running: list[Prompt] = []
        self._dropped: list[Prompt] = []  # cancelled while waiting for a shared query's KV
        self._stop = False
        self._thread = threading.Thread(target=self._main, name="engine-loop", daemon=True)
        self.engine: Any = None
        self.state = "new"  # new -> loading -> ready -> stopped | failed
        self.error: str | None = None
        self._on_loaded: OnLoaded | None = None
        self.info: EngineInfo | None = None
        self._finish_rate = FinishRate()

    def start(self, on_loaded: OnLoaded | None = None) -> None:
        """Load the engine on the engine thread; `on_loaded(None | error)` runs there once."""
        self._on_loaded = on_loaded
        self.state = "loading"
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.state in ("loading", "ready")

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    def stats(self) -> EngineStats:
        eng = self.engine
        counts, runs = (dict(eng.forward_counts), dict(eng.runs)) if eng is not None else ({}, {})
        held = (self.leases.pages, self.leases.tokens, self.leases.expired) if self.leases else (
            0, 0, 0)
        return EngineStats(len(self._waiting), len(self._running), self.kv_used_tokens,
                           self.kv_cached_tokens, counts, runs, *held,
                           self.hook.stats() if self.hook else {})

    @property
    def kv_used_tokens(self) -> int:
        """KV tokens (whole pages) held by in-flight requests; idle cached pages excluded."""
        return self.cache.used_pages * self.cache.page_size if self.cache else 0

    @property
    def kv_cached_tokens(self) -> int:
        return self.cache.cached_pages * self.cache.page_size if self.cache else 0

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def in_flight(self) -> int:
        return len(self._waiting) + len(self._running)

    def retry_after_s(self) -> int:
        return self._finish_rate.retry_after_s(len(self._waiting))

    def admission_error(self, prompts: int = 1) -> Exception | None:
        """Why `prompts` more prompts cannot be queued now, or None; lock-free."""
        if self._stop and self.state == "ready":
            return NotReady(SHUTTING_DOWN)
        return admission_error(self.state, self.error, len(self._waiting), prompts,
                               self.max_queue, self.retry_after_s())

    def submit(self, reqs: list[Prompt]) -> None:
        """Queue all of `reqs` or none of them; raises NotReady, QueueFull, KVPoolExhausted."""
        with self._cv:
            # a shared query is no prompt of the client's: it does not count against the queue
            if (err := self.admission_error(sum(not r.items_left for r in reqs))) is not None:
                raise err
            alloc, ps = self.engine.pool.allocator, self.engine.pool.page_size
            for r in reqs:
                # + the shared query's page it copies, held with it
                need = pages_for(r.num_tokens, ps) + (r.shared % ps > 0)
                if need > alloc.capacity:
                    raise KVPoolExhausted(f"a prompt of {r.num_tokens} tokens needs {need} KV "
                                          f"pages; the pool has {alloc.capacity} "
                                          f"({alloc.capacity * ps} tokens)")
            if self.hook is not None:
                for r in reqs:
                    r.wants_hidden = r.wants_hidden or self.hook.wants_hidden(r)
            self._waiting.extend(reqs)
            self._queue_changed()
            self._cv.notify()

    def cancel(self, req: Prompt) -> None:
        """Client gone: a running request frees its pages after its current forward."""
        with self._cv:
            req.cancelled = True
            if req in self._waiting:
                self._waiting.remove(req)
                if req.base is not None:
                    self._dropped.append(req)
                self._queue_changed()
            self._cv.notify()

    def abort(self, exc: BaseException) -> int:
        with self._cv:
            pending = list(self._waiting) + [r for r in self._running if not r.cancelled]
            self._waiting.clear()
            self._queue_changed()
            for r in pending:
                r.cancelled = True
                r.answer(None, exc)
            self._cv.notify()
        return len(pending)

    def stop(self, timeout: float = 1.0) -> None:
        """End the engine loop after its current forward, waiting at most `timeout`."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.abort(NotReady(SHUTTING_DOWN))
        with self._cv:
            if self.state in ("loading", "ready"):
                self.state = "stopped"

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify()

    def _queue_changed(self) -> None:
        if self._on_queue is not None:
            self._on_queue(len(self._waiting), self.retry_after_s())

    def _main(self) -> None:
        t0 = time.perf_counter()
        try:
            engine = self._factory()
            if self.hook is not None:
                self.hook.start(engine)
        except BaseException as e:  # noqa: BLE001 - any load failure is reported, not raised
            log.debug("engine failed to load", exc_info=True)
            self._fail(f"engine failed to load: {type(e).__name__}: {e}")
            return
        with self._cv:
            self.engine = engine
            self.info = dataclasses.replace(engine.info(), load_seconds=time.perf_counter() - t0)
            self.cache = PrefixCache(engine.pool.allocator, engine.pool.page_size,
                                     self.prefix_cache_enabled)
            self.leases = Leases(self.cache.hold, self.cache.release, self._wake)
            self._sizer = ChunkSizer(engine.model_cfg) if engine.synchronous else None
            if self.state == "loading":
                self.state = "ready"
        self._post_loaded(None)
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - a bug here must not hang clients
            log.exception("engine loop died")
            self._fail(f"engine loop died: {type(e).__name__}: {e}")
        finally:
            with self._cv:
                for r in list(self._running):
                    self._release(r)
                self.leases.drop_all()
                self.cache.clear()
            for close in ((self.hook.close,) if self.hook else ()) + (engine.close,):
                try:
                    close()
                except Exception:  # noqa: BLE001
                    log.exception("closing %s failed", close)

    def _loop(self) -> None:
        """Launch batch n + 1, then finish batch n (a synchronous engine: finish each at once)."""
        pending: InFlight | None = None
        while (batch := self._next_batch(block=pending is None)) is not None:
            launched = self._launch(batch) if batch else None
            if pending is not None:
                self._finish(*pending)
            pending = launched
            if pending is not None and self.engine.synchronous:
                self._finish(*pending)
                pending = None
        if pending is not None:
            self._finish(*pending)

    def _post_loaded(self, exc: BaseException | None) -> None:
        if self._on_loaded is not None:
            try:
                self._on_loaded(exc)
            except Exception:  # noqa: BLE001
                log.exception("reporting the engine's load failed")

    def _fail(self, msg: str) -> None:
        with self._cv:
            self.state, self.error = "failed", msg
            pending, self._waiting, self._running = [*self._waiting, *self._running], deque(), []
            self._queue_changed()
        for r in pending:
            r.answer(None, NotReady(msg))
        self._post_loaded(RuntimeError(msg))

    def _release(self, r: Prompt) -> None:
        if r.pages:
            self.cache.release(r.own_pages(self.cache.page_size))
            r.pages = []
            if r.base is not None:
                r.base.item_over(self.cache.release)
        if r in self._running:
            self._running.remove(r)

    def _next_batch(self, block: bool) -> Batch | None:
        """The next batch; [] when there is none and not `block`; None once stopping."""
        while True:
            if self._poll is not None:
                self._poll(0.0)
            with self._cv:
                if self._stop:
                    return None
                for r in [r for r in self._running if r.cancelled]:
                    self._release(r)
                for r in self._dropped:
                    r.base.item_over(self.cache.release)
                self._dropped.clear()
                self.leases.reap()
                batch = self._form_batch()
                if batch or not block:
                    return batch
                if self._poll is None:
                    self._cv.wait(self.leases.wait_s())
                    continue
            self._poll(POLL_IDLE_S)

    def _form_batch(self) -> Batch:
        waiting = len(self._waiting)
        batch = form_batch(self._running, self._waiting, self.cache, self.engine.max_batch_tokens,
                           self.max_batch_prompts, self.max_logit_rows,
                           self._sizer.cap if self._sizer else None)
        if len(self._waiting) != waiting:
            self._queue_changed()
        return batch

    def _launch(self, batch: Batch) -> InFlight | None:
        self.launching_since = time.monotonic()
        try:
            if copies := [r for r, _ in batch if r.copy_tail is not None]:
                # on this thread's stream: ordered between the forwards launched and the next
                self.engine.pool.copy_pages(*zip(*(r.copy_tail for r in copies)))
                for r in copies:
                    r.copy_tail = None
            return batch, self.engine.launch([c for _, c in batch])
        except Exception as e:  # noqa: BLE001 - fail this batch only, keep serving
            self._fail_batch(batch, e)
            return None
        finally:
            self.launching_since = 0.0

    def _fail_batch(self, batch: Batch, e: Exception) -> None:
        log.exception("forward of %d chunks failed", len(batch))
        err = ForwardFailed(f"forward failed: {type(e).__name__}: {e}")
        with self._cv:
            for r, _ in batch:
                self._release(r)
                if not r.cancelled:
                    r.cancelled = True
                    r.answer(None, err)

    def _finish(self, batch: Batch, launched: Any) -> None:
        try:
            if self._poll is not None:
                while not launched.ready():
                    self._poll(0.0)
            out = launched.wait()
        except Exception as e:  # noqa: BLE001
            self._fail_batch(batch, e)
            return
        self.observer.on_forward(out.mode, out.seconds, sum(c.num_tokens for _, c in batch),
                                 len(batch))
        if self._sizer:
            self._sizer.measured([c for _, c in batch], out.seconds)
        finished = absorb_batch(batch, out, self.cache, self.hook, self.leases)
        with self._cv:
            for r, res, exc in finished:
                self._release(r)
                if not r.cancelled:
                    if exc is not None:
                        r.cancelled = True  # a later chunk in flight is dropped
                    r.answer(res, exc)
            self._finish_rate.add(time.perf_counter(),
                                  sum(res is not None for _, res, _ in finished))
            self._queue_changed()
