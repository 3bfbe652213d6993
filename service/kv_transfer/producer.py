"""The KV producer: a finished prompt's KV offered to a vLLM decode that pulls it over NIXL.

On finish, a `remote_decode` prompt's pages are staged in the export region and leased under a
request id until the decode's done notification or the lease's expiry; the answer carries the
`kv_transfer_params` vLLM's own prefill would send."""

from __future__ import annotations

import logging
import threading
import uuid
from typing import TYPE_CHECKING, Any

import torch

from service.config import EngineConfig
from service.engine.finish import FinishHook, Keep, Lease, Leases
from service.engine.interface import KVPoolExhausted, PromptResult
from service.engine.pages import pages_for
from service.kv_transfer import wire
from service.kv_transfer.agent import NixlAgent
from service.kv_transfer.export import ExportRegion, export_pages
from service.kv_transfer.side_channel import SideChannel, SideChannelError

if TYPE_CHECKING:
    from service.engine.core import EngineCore
    from service.engine.prompt import Prompt

log = logging.getLogger(__name__)

POLL_S = 0.002  # notifications are polled: a done notification frees its pages this soon
HEARTBEAT_SHARE = 2 / 3  # a heartbeat extends a lease to this share of KV_LEASE_S (vLLM's)


class NixlProducer(FinishHook):
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        # a restarted producer must not reuse an id: decodes cache agents by engine id
        self.engine_id = f"{cfg.kv_transfer_engine_id}-{uuid.uuid4().hex[:8]}"
        self._lock = threading.Lock()
        self._offers: dict[str, Lease] = {}
        self._next = 0
        self.counts = dict.fromkeys(("offered", "offered_bytes", "notified", "heartbeats",
                                     "refused", "unknown_notifications"), 0)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.side: SideChannel | None = None
        self.agent: NixlAgent | None = None
        self.leases: Leases | None = None  # on the export region's pages, from start()

    def start(self, engine: EngineCore) -> None:
        pool, mcfg, cfg = engine.pool, engine.model_cfg, self.cfg
        self._pool = pool
        self.region = ExportRegion(mcfg, export_pages(cfg.kv_transfer_tokens, pool.page_size),
                                   pool.page_size, pool.data.dtype, pool.data.device)
        dev = pool.data.device
        mem, device_id = ("VRAM" if dev.type == "cuda" else "DRAM"), dev.index or 0
        self.agent = NixlAgent(self.engine_id, self.region, mem, device_id)
        factors = wire.HashFactors(
            model=cfg.kv_transfer_decode_model, dtype=str(pool.data.dtype),
            num_kv_heads=mcfg.num_kv_heads, head_size=mcfg.head_dim,
            num_hidden_layers=mcfg.num_layers, attn_backend_name=cfg.kv_transfer_decode_backend,
            vllm_version=cfg.kv_transfer_vllm_version)
        self.hash = wire.compatibility_hash(factors)
        payload = wire.handshake_payload(self.hash, wire.agent_metadata(
            engine_id=self.engine_id, nixl_metadata=self.agent.metadata(),
            base_addrs=self.region.base_addrs, device_id=device_id,
            num_blocks=self.region.num_blocks, block_len=self.region.block_len,
            block_size=pool.page_size, mem_type=mem))
        self.leases = Leases(lambda pages: None, self.region.free)
        self.side = SideChannel(cfg.kv_transfer_host, cfg.kv_transfer_port, lambda: payload)
        try:
            self.side.start()
        except SideChannelError as e:
            raise SideChannelError(f"{e}: set KV_TRANSFER_HOST / KV_TRANSFER_PORT") from None
        self._thread = threading.Thread(target=self._serve, name="kv-transfer", daemon=True)
        self._thread.start()
        log.info("KV transfer: engine %s on %s:%d, %d export tokens, compatibility hash %s of %s",
                 self.engine_id, cfg.kv_transfer_host, cfg.kv_transfer_port,
                 self.region.allocator.capacity * pool.page_size, self.hash, factors.as_dict())

    def on_finish(self, prompt: Prompt, result: PromptResult, hidden: torch.Tensor | None,
                  keep: Keep) -> PromptResult | None:
        if not prompt.params.remote_decode:
            return None
        pages = prompt.pages[:pages_for(prompt.num_tokens, self._pool.page_size)]
        with self._lock:
            try:
                ids = self.region.stage(self._pool.data, pages)
            except KVPoolExhausted as e:  # the decode then recomputes the prompt
                self.counts["refused"] += 1
                log.warning("KV not offered (%s); raise KV_TRANSFER_TOKENS", e)
                return None
            rid = f"{self.engine_id}-{self._next}"
            self._next += 1
            self._offers[rid] = self.leases.take(ids, prompt.num_tokens, self.cfg.kv_lease_s)
            self.counts["offered"] += 1
            self.counts["offered_bytes"] += len(ids) * self.region.block_len * len(
                self.region.base_addrs)
        if self.region.data.is_cuda:  # the decode may read as soon as it has the answer
            torch.cuda.current_stream().synchronize()
        return result._replace(kv_transfer=self.params(rid, ids, prompt.num_tokens,
                                                       result.cached_tokens))

    def params(self, rid: str, ids: list[int], tokens: int, cached: int) -> dict[str, Any]:
        """What vLLM's prefill answers (pull_scheduler.request_finished, the scheduler's)."""
        return dict(do_remote_prefill=True, do_remote_decode=False, remote_block_ids=[ids],
                    remote_engine_id=self.engine_id, remote_request_id=rid,
                    remote_host=self.cfg.kv_transfer_host, remote_port=self.cfg.kv_transfer_port,
                    tp_size=1, dcp_size=1, pp_size=1, remote_num_tokens=tokens,
                    remote_blocks_expiry_time=None, transfer_mode="pull",
                    remote_prefill_cached_tokens=cached)

    def _serve(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self._notified(self.agent.notifications())
                self._reap()
            except Exception:  # noqa: BLE001 - one bad notification must not stop the rest
                log.exception("KV transfer notification handling failed")

    def _notified(self, messages: list[bytes]) -> None:
        for raw in messages:
            try:
                note = wire.parse_notification(raw)
            except wire.WireError as e:
                self.counts["unknown_notifications"] += 1
                log.error("%s", e)
                continue
            with self._lock:
                if isinstance(note, wire.Heartbeat):
                    self.counts["heartbeats"] += 1
                    until = self.leases.clock() + self.cfg.kv_lease_s * HEARTBEAT_SHARE
                    for rid in note.request_ids:
                        if (lease := self._offers.get(rid)) is not None:
                            lease.expires_at = max(lease.expires_at, until)
                    continue
                # NOTE: the count is 1 (TP 1): one reader's notification frees the offer
                lease = self._offers.pop(note.request_id, None)
                if lease is None:
                    self.counts["unknown_notifications"] += 1
                    log.error("a decode read KV of unknown or expired request %s",
                              note.request_id)
                    continue
                self.counts["notified"] += 1
                lease.release()

    def _reap(self) -> None:
        with self._lock:
            now = self.leases.clock()
            late = [rid for rid, lease in self._offers.items() if lease.expires_at <= now]
            for rid in late:
                del self._offers[rid]
            self.leases.reap()
        if late:
            log.warning("KV of %d requests expired unpulled after KV_LEASE_S=%g (e.g. %s); a "
                        "decode whose compatibility hash is not ours (%s) refuses to pull",
                        len(late), self.cfg.kv_lease_s, late[0], self.hash)

    def stats(self) -> dict[str, int]:
        leases = self.leases
        if leases is None:
            return {}
        return {**self.counts, "leased_pages": leases.pages, "leased_tokens": leases.tokens,
                "expired": leases.expired,
                "handshakes": self.side.served if self.side else 0}

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        if self.side is not None:
            self.side.close()
        with self._lock:
            if self.leases is not None:
                self.leases.drop_all()
                self._offers.clear()
        if self.agent is not None:
            self.agent.close()
