"""The KV producer through the real scheduler and EngineCore on CPU, NIXL replaced by a fake
agent: what a prompt with do_remote_decode answers, the staged pages, vLLM's handshake on the
side channel, and the lease: released by the done notification, extended by heartbeats,
expired and counted, dropped at shutdown."""

from __future__ import annotations

import asyncio
import threading

import msgspec
import pytest
import torch
import zmq

from service.engine.core import EngineCore
from service.engine.scheduler import Scheduler
from service.kv_transfer import producer as producer_mod
from service.kv_transfer import wire
from service.kv_transfer.producer import NixlProducer
from tests.engine.helpers import PAGE, engine_cfg, free_port, prompts, tiny_loaded
from tests.engine.test_scheduler import req, run, start, until

VLLM_FIELDS = ["do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
               "remote_request_id", "remote_host", "remote_port", "tp_size", "dcp_size",
               "pp_size", "remote_num_tokens", "remote_blocks_expiry_time", "transfer_mode",
               "remote_prefill_cached_tokens"]


class FakeAgent:
    """NixlAgent's interface; `send` queues notifications as a decode's agent would."""

    def __init__(self, name, region, mem_type="DRAM", device_id=0):
        self.name, self.region, self.mem_type = name, region, mem_type
        self._notes: list[bytes] = []
        self._lock = threading.Lock()
        self.closed = False

    def metadata(self) -> bytes:
        return b"nixl-metadata-of-" + self.name.encode()

    def send(self, note: str) -> None:
        with self._lock:
            self._notes.append(note.encode())

    def notifications(self) -> list[bytes]:
        with self._lock:
            out, self._notes = self._notes, []
        return out

    def close(self) -> None:
        self.closed = True


@pytest.fixture(autouse=True)
def fake_nixl(monkeypatch):
    monkeypatch.setattr(producer_mod, "NixlAgent", FakeAgent)


def producer(**kw) -> tuple[EngineCore, NixlProducer]:
    cfg = engine_cfg(kv_transfer="nixl", kv_transfer_host="127.0.0.1",
                     kv_transfer_port=free_port(), kv_transfer_engine_id="prefill-test",
                     kv_transfer_decode_model="/models/tiny",
                     **{"kv_lease_s": 30.0, "kv_transfer_tokens": 64, **kw})
    return EngineCore(cfg, loaded=tiny_loaded(seed=5)), NixlProducer(cfg)


async def scheduler(eng: EngineCore, hook: NixlProducer) -> Scheduler:
    s = Scheduler(lambda: eng, max_queue=16, max_batch_prompts=8, finish_hook=hook)
    await start(s)
    return s


def staged_pages(pool: torch.Tensor, pages: list[int]) -> torch.Tensor:
    """vLLM's LBHNC page of each layer: [kv_heads][tokens][K | V], built row by row."""
    _, layers, _, heads, dim = pool.shape
    out = torch.empty(layers, len(pages), heads, PAGE, 2 * dim)
    for i, p in enumerate(pages):
        for t in range(PAGE):
            out[:, i, :, t, :dim] = pool[0, :, p * PAGE + t]
            out[:, i, :, t, dim:] = pool[1, :, p * PAGE + t]
    return out


def test_a_remote_decode_prompt_is_staged_leased_and_released_by_the_done_notification():
    eng, hook = producer()
    ids = prompts(eng.model_cfg.vocab_size, [23], seed=1)[0]  # 6 pages of 4 tokens

    seen, on_finish = [], hook.on_finish
    hook.on_finish = lambda prompt, *a: seen.append(list(prompt.pages)) or on_finish(prompt, *a)

    async def main():
        s = await scheduler(eng, hook)
        plain = req(ids[:5])
        s.submit([plain])
        assert (await plain.future).kv_transfer is None  # not asked: nothing offered
        r = req(ids, remote_decode=True)
        s.submit([r])
        res = await r.future
        kv = res.kv_transfer
        assert list(kv) == VLLM_FIELDS
        assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
        assert kv["remote_engine_id"] == hook.engine_id and kv["remote_num_tokens"] == 23
        assert (kv["remote_host"], kv["remote_port"]) == ("127.0.0.1", hook.cfg.kv_transfer_port)
        assert kv["remote_prefill_cached_tokens"] == res.cached_tokens == 4  # ids[:4] cached
        (blocks,) = kv["remote_block_ids"]
        assert len(blocks) == 6 and 0 not in blocks
        got = hook.region.data[:, blocks]
        want = staged_pages(eng.pool.data, seen[-1])
        assert torch.equal(got[:, :5], want[:, :5])  # the last page: its 3 written rows only
        assert torch.equal(got[:, 5, :, :3], want[:, 5, :, :3])
        st = s.stats().kv_transfer
        assert (st["leased_pages"], st["leased_tokens"], st["offered"]) == (6, 23, 1)
        assert st["offered_bytes"] == 6 * hook.region.block_len * eng.model_cfg.num_layers
        assert s.kv_used_tokens == 0  # the pool's pages went back: the export pages hold it
        hook.agent.send(f"{kv['remote_request_id']}:1")
        await until(lambda: s.stats().kv_transfer["leased_pages"] == 0, "the release")
        st = s.stats().kv_transfer
        assert (st["notified"], st["expired"]) == (1, 0)
        hook.agent.send(f"{kv['remote_request_id']}:1")  # twice: unknown now, counted
        await until(lambda: s.stats().kv_transfer["unknown_notifications"] == 1, "the count")
        s.stop()
        assert hook.agent.closed and hook.region.num_free == hook.region.allocator.capacity

    run(main())


def test_an_unpulled_offer_expires_unless_heartbeats_extend_it():
    eng, hook = producer(kv_lease_s=0.3)

    async def main():
        s = await scheduler(eng, hook)
        a, b = (req(p, remote_decode=True)
                for p in prompts(eng.model_cfg.vocab_size, [9, 7], seed=2))
        s.submit([a, b])
        ka, kb = (await a.future).kv_transfer, (await b.future).kv_transfer
        for _ in range(8):  # a decode still waiting on b: vLLM's "HB:<ids>" every lease / 6
            hook.agent.send(f"HB:{kb['remote_request_id']},unknown-id")
            await asyncio.sleep(0.05)
        assert s.stats().kv_transfer["expired"] == 1  # a expired; b's heartbeats kept it
        assert s.stats().kv_transfer["leased_tokens"] == 7
        await until(lambda: s.stats().kv_transfer["expired"] == 2, "b's expiry")
        assert s.stats().kv_transfer["leased_pages"] == 0
        assert hook.region.num_free == hook.region.allocator.capacity
        assert ka["remote_request_id"] != kb["remote_request_id"]
        s.stop()

    run(main())


def test_a_full_export_region_answers_without_an_offer_and_counts():
    eng, hook = producer(kv_transfer_tokens=16)  # 4 pages of 4 tokens

    async def main():
        s = await scheduler(eng, hook)
        r = req(prompts(eng.model_cfg.vocab_size, [30], seed=3)[0], remote_decode=True)
        s.submit([r])
        res = await r.future
        assert res.kv_transfer is None and res.prompt_tokens == 30  # answered all the same
        assert s.stats().kv_transfer["refused"] == 1
        s.stop()

    run(main())


def test_the_side_channel_answers_vllms_handshake_with_our_pool():
    eng, hook = producer()

    async def main():
        s = await scheduler(eng, hook)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.REQ)  # as vLLM's decode: one frame, two back
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        sock.connect(f"tcp://127.0.0.1:{hook.cfg.kv_transfer_port}")
        sock.send(msgspec.msgpack.encode((wire.GET_META_MSG, 0, 0)))
        payload, ts = sock.recv_multipart()
        sock.close()
        ctx.term()
        p = msgspec.msgpack.decode(payload, type=wire.HandshakePayload)
        m = msgspec.msgpack.decode(p.agent_metadata_bytes, type=wire.AgentMetadata)
        cfg = eng.model_cfg
        assert p.compatibility_hash == wire.compatibility_hash(wire.HashFactors(
            model="/models/tiny", dtype="torch.float32", num_kv_heads=cfg.num_kv_heads,
            head_size=cfg.head_dim, num_hidden_layers=cfg.num_layers,
            attn_backend_name="FLASH_ATTN"))
        assert m.engine_id == hook.engine_id and m.agent_metadata == hook.agent.metadata()
        assert m.kv_caches_base_addr == [t.data_ptr() for t in hook.region.data.unbind(0)]
        assert m.block_lens == [cfg.num_kv_heads * PAGE * 2 * cfg.head_dim * 4] * cfg.num_layers
        assert (m.block_size, m.kv_cache_layout, m.attn_backend_name) == (
            PAGE, "LBHNC", "FLASH_ATTN")
        assert isinstance(msgspec.msgpack.decode(ts), float)
        assert s.stats().kv_transfer["handshakes"] == 1
        s.stop()

    run(main())


def test_each_start_gets_a_fresh_engine_id():
    """A decode caches agents by engine id: a restarted producer must not reuse one."""
    (_, a), (_, b) = producer(), producer()
    assert a.engine_id != b.engine_id and a.engine_id.startswith("prefill-test-")
