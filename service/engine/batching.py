"""Which prompts' chunks go into the next forward: running prompts first, then admissions."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from service.engine.batch import SeqChunk
from service.engine.pages import page_keys, pages_for
from service.engine.prefix_cache import PrefixCache
from service.engine.prompt import Prompt

Batch = list[tuple[Prompt, SeqChunk]]


def form_batch(running: list[Prompt], waiting: deque[Prompt], cache: PrefixCache,
               budget: int, max_prompts: int, rows: int,
               cap: Callable[[int], int] | None = None) -> Batch:
    """Up to `budget` tokens, `max_prompts` chunks, `rows` logprob rows, chunks of at most cap(p)
    after p tokens; FIFO admission with all of a prompt's pages."""
    ps = cache.page_size
    out: Batch = []
    taken: set[int] = set()

    def take(r: Prompt) -> None:
        nonlocal budget, rows
        n = min(r.num_tokens - r.done, budget)
        if cap is not None:
            n = min(n, cap(r.done))
        if r.params.prompt_logprobs:
            n = min(n, rows)
            rows -= n
        if n > 0:
            out.append((r, r.next_chunk(n, ps)))
            taken.add(id(r))
            budget -= n

    for r in running:
        if len(out) >= max_prompts or budget <= 0:
            return out
        take(r)
    while waiting and len(out) < max_prompts and budget > 0:
        r = waiting[0]
        base = r.base
        if base is not None:
            if base.cancelled:  # its query failed or was cancelled, which answered for it
                waiting.popleft()
                r.cancelled = True
                base.item_over(cache.release)
                continue
            if base.done < base.num_tokens or id(base) in taken:
                break  # its query's KV is written by a forward launched before this one
        if r.params.prompt_logprobs and rows <= 0:
            break
        if base is not None:
            reuse = base.group_pages[:r.shared // ps]  # the query keeps them until r is over
        else:
            if r.keys is None:
                r.keys = page_keys(r.ids, ps) if cache.enabled else []
            # prompt logprobs need every position's logits; the last token is always computed
            # mean/cls pooling reads every row's hidden state, which a cached prefix skips
            reuse = ([] if r.params.prompt_logprobs or r.params.pool in ("mean", "cls")
                     else cache.match(r.keys, (r.num_tokens - 1) // ps))
        need = pages_for(r.num_tokens, ps) - len(reuse)
        if need > cache.available_pages:
            if base is None:
                cache.release(reuse)
            break  # wait for pages rather than let smaller prompts overtake
        waiting.popleft()
        r.pages = reuse + cache.alloc(need)
        r.cached = r.done = len(reuse) * ps
        if base is not None:
            if r.shared % ps:  # the query's part-filled last page: a copy of it is this one's
                r.copy_tail = base.group_pages[len(reuse)], r.pages[len(reuse)]
            r.cached = r.done = r.shared
        elif r.items_left:
            r.group_pages = list(r.pages)
            cache.hold(r.group_pages)
        r.admitted_at = time.perf_counter()
        running.append(r)
        take(r)
    return out
