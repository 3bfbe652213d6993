"""vLLM 0.32 NixlConnector wire format: handshake, agent metadata, hash, notifications."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Annotated, NamedTuple

import msgspec

PINNED_VLLM = "0.32.0"
NIXL_CONNECTOR_VERSION = 14
GET_META_MSG = b"get_meta_msg"
KV_CACHE_LAYOUT = "LBHNC"
# NOTE: a CPU decode converts pages only from a producer advertising a backend other than its own
ADVERTISED_BACKEND = "FLASH_ATTN"
MAX_REQUEST_BYTES = 64  # vLLM's request is 17 bytes; anything far larger is not one


class WireError(ValueError):
    """A malformed side-channel request or NIXL notification."""


class HashFactors(msgspec.Struct, frozen=True, kw_only=True):
    """vLLM's compatibility-hash inputs, as the decode sees them (model = its --model string)."""

    model: str
    dtype: str  # str(torch dtype), e.g. "torch.float32"
    num_kv_heads: int
    head_size: int
    num_hidden_layers: int
    attn_backend_name: str  # the decode's own backend: it hashes its own name
    cache_dtype: str = "auto"
    is_hma_enabled: bool = True
    vllm_version: str = PINNED_VLLM
    transfer_mode: str = "pull"

    def as_dict(self) -> dict[str, object]:
        return {
            "vllm_version": self.vllm_version,
            "nixl_connector_version": NIXL_CONNECTOR_VERSION,
            **{f: getattr(self, f) for f in self.__struct_fields__ if f != "vllm_version"},
            "speculative_config": None,
        }


def compatibility_hash(factors: HashFactors) -> str:
    """sha256 of vLLM's json.dumps(factors, sort_keys=True) (vllm.config.utils.hash_factors)."""
    return hashlib.sha256(json.dumps(factors.as_dict(), sort_keys=True).encode()).hexdigest()


class AgentMetadata(msgspec.Struct, kw_only=True):
    """vLLM's NixlAgentMetadata: msgspec encodes it as a map of every field in this order."""

    engine_id: str
    agent_metadata: bytes
    kv_caches_base_addr: list[int]
    device_id: int
    num_blocks: int
    block_lens: list[int]
    block_strides: list[int]
    kv_cache_layout: str
    block_size: int
    ssm_sizes: tuple[int, int]
    attn_backend_name: str
    physical_blocks_per_logical_kv_block: int
    region_num_blocks: list[int] | None = None
    region_group_ids: list[int] | None = None
    region_names: list[str] | None = None
    region_mem_types: list[str] | None = None
    dcp_size: int = 1
    pcp_size: int = 1
    ple_block_len: int | None = None
    region_members: list[list[str]] = []
    packed_member_layouts: dict[str, tuple[int, int]] = {}


class HandshakePayload(msgspec.Struct):
    compatibility_hash: str
    agent_metadata_bytes: bytes


def agent_metadata(
    *,
    engine_id: str,
    nixl_metadata: bytes,
    base_addrs: Sequence[int],
    num_blocks: int,
    block_len: int,
    block_size: int,
    mem_type: str = "DRAM",
    device_id: int = 0,
    attn_backend_name: str = ADVERTISED_BACKEND,
    region_names: list[str] | None = None,
) -> bytes:
    """Encoded metadata for one region per layer, each `num_blocks` contiguous LBHNC pages."""
    assert mem_type in ("DRAM", "VRAM"), f"NIXL memory type {mem_type!r}: DRAM or VRAM"
    regions = len(base_addrs)
    return msgspec.msgpack.encode(
        AgentMetadata(
            engine_id=engine_id,
            agent_metadata=nixl_metadata,
            kv_caches_base_addr=list(base_addrs),
            device_id=device_id,
            num_blocks=num_blocks,
            block_lens=[block_len] * regions,
            block_strides=[block_len] * regions,
            kv_cache_layout=KV_CACHE_LAYOUT,
            block_size=block_size,
            ssm_sizes=(0, 0),
            attn_backend_name=attn_backend_name,
            physical_blocks_per_logical_kv_block=1,
            region_num_blocks=[num_blocks] * regions,
            region_group_ids=[0] * regions,
            region_names=region_names,
            region_mem_types=[mem_type] * regions,
        )
    )


def handshake_payload(compat_hash: str, metadata: bytes) -> bytes:
    """The first reply frame: the hash and the encoded agent metadata."""
    return msgspec.msgpack.encode(HandshakePayload(compat_hash, metadata))


_Rank = Annotated[int, msgspec.Meta(ge=0)]
_request = msgspec.msgpack.Decoder(tuple[bytes, _Rank, _Rank])


def parse_request(frame: bytes) -> tuple[int, int]:
    """(pp_rank, tp_rank) of a decode's msgpack [bin GET_META_MSG, pp_rank, tp_rank] frame."""
    if len(frame) > MAX_REQUEST_BYTES:
        raise WireError(f"handshake request of {len(frame)} bytes (at most {MAX_REQUEST_BYTES})")
    try:
        msg, pp_rank, tp_rank = _request.decode(frame)
    except msgspec.MsgspecError as e:
        raise WireError(f"handshake request {frame[:24]!r}: {e}") from None
    if msg != GET_META_MSG:
        raise WireError(f"handshake request {msg[:24]!r}, expected {GET_META_MSG!r}")
    return pp_rank, tp_rank


class Done(NamedTuple):
    """A decode finished reading `request_id` (`count` = readers the producer waits for)."""

    request_id: str
    count: int


class Heartbeat(NamedTuple):
    """A decode still waits to read these requests: extend their leases."""

    request_ids: tuple[str, ...]


def parse_notification(msg: bytes) -> Done | Heartbeat:
    """A NIXL notification: "<request_id>:<count>" or "HB:<id>,<id>,..."."""
    try:
        text = msg.decode()
    except UnicodeDecodeError:
        raise WireError(f"notification {msg[:40]!r} is not UTF-8") from None
    if text.startswith("HB:"):
        return Heartbeat(tuple(i for i in text[3:].split(",") if i))
    request_id, _, count = text.rpartition(":")
    if not request_id or not (count.isascii() and count.isdigit()):
        raise WireError(f"notification {text[:80]!r}: expected '<request_id>:<count>' or 'HB:ids'")
    return Done(request_id, int(count))
