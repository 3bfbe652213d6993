"""API worker <-> engine messages: msgpack structs over ZeroMQ, token ids as int32, no pickle."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

from service.config import EngineConfig
from service.engine.interface import (
    EngineInfo,
    EngineStats,
    ForwardFailed,
    InvalidRequest,
    KVPoolExhausted,
    NotReady,
    PromptResult,
    QueueFull,
    RequestDropped,
    SamplingParams,
)
from service.engine.pages import KEY_BYTES


class Hello(msgspec.Struct, tag=True, array_like=True):
    worker: int


class Submit(msgspec.Struct, tag=True, array_like=True):
    worker: int
    rid: int
    prompts: list[bytes]  # int32 token ids, one buffer per prompt
    params: SamplingParams
    keys: list[bytes] = []  # per prompt, its prefix-cache page keys joined; [] = none sent
    # > 0: the prompts share their first `shared` tokens; later prompts carry only the rest
    shared: int = 0


class Cancel(msgspec.Struct, tag=True, array_like=True):
    worker: int
    rids: list[int]


class Audit(msgspec.Struct, tag=True, array_like=True):
    """A worker's unanswered requests; each the engine does not hold is answered `dropped`."""

    worker: int
    rids: list[int]


class StatsQuery(msgspec.Struct, tag=True, array_like=True):
    worker: int
    qid: int


class WorkerGone(msgspec.Struct, tag=True, array_like=True):
    """From the supervisor: a worker died; what it submitted is cancelled."""

    worker: int


class Status(msgspec.Struct, tag=True, array_like=True):
    state: str
    error: str | None = None
    info: EngineInfo | None = None


class Failure(msgspec.Struct, array_like=True):
    kind: str
    message: str
    retry_after_s: int = 0


class Done(msgspec.Struct, tag=True, array_like=True):
    rid: int
    results: list[PromptResult] | None
    failure: Failure | None


class StatsReply(msgspec.Struct, tag=True, array_like=True):
    qid: int
    stats: EngineStats


ToEngine = Hello | Submit | Cancel | Audit | StatsQuery | WorkerGone
ToWorker = Status | Done | StatsReply

ERRORS: dict[str, type[Exception]] = {
    "queue_full": QueueFull,
    "not_ready": NotReady,
    "kv_exhausted": KVPoolExhausted,
    "forward_failed": ForwardFailed,
    "invalid": InvalidRequest,
    "dropped": RequestDropped,
}
_KINDS = {cls: kind for kind, cls in ERRORS.items()}

_encoder = msgspec.msgpack.Encoder()
_to_engine = msgspec.msgpack.Decoder(ToEngine)
_to_worker = msgspec.msgpack.Decoder(ToWorker)
encode = _encoder.encode
to_engine = _to_engine.decode
to_worker = _to_worker.decode


def failure(exc: BaseException) -> Failure:
    kind = next((k for cls, k in _KINDS.items() if isinstance(exc, cls)), "forward_failed")
    return Failure(kind, str(exc), getattr(exc, "retry_after_s", 0))


def exception(f: Failure) -> Exception:
    if f.kind == "queue_full":
        return QueueFull(f.message, f.retry_after_s)
    return ERRORS.get(f.kind, ForwardFailed)(f.message)


def max_submit_bytes(cfg: EngineConfig) -> int:
    """The largest Submit the service's own limits allow, plus room for the rest."""
    per_token = 4 + -(-KEY_BYTES // cfg.page_size)
    return cfg.max_queue_requests * (cfg.max_prompt_tokens * per_token + 64) + (1 << 20)


def pack_ids(ids: Sequence[int] | np.ndarray) -> bytes:
    return np.asarray(ids, dtype=np.int32).tobytes()


def unpack_ids(buf: bytes) -> np.ndarray:
    return np.frombuffer(buf, dtype=np.int32)


@dataclass(frozen=True)
class Addresses:
    """The engine's ZeroMQ endpoints and queue board, in one private directory."""

    inbox: str  # Submit, Cancel, WorkerGone: PUSHed here, read by the engine thread
    control: str  # Hello, StatsQuery: PUSHed here, answered by the engine's main thread
    outbox: str  # the engine's ROUTER; each worker's DEALER has its id as routing id
    board: str

    @classmethod
    def in_dir(cls, directory: str | Path) -> Addresses:
        d = Path(directory)
        return cls(f"ipc://{d / 'engine-in'}", f"ipc://{d / 'engine-ctl'}",
                   f"ipc://{d / 'engine-out'}", str(d / "queue"))


def routing_id(worker: int) -> bytes:
    return b"w%d" % worker
