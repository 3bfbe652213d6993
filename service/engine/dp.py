"""SGLang's DP attention: data-parallel attention, a gathered tensor-parallel MLP, in lockstep."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from service.config import EngineConfig
from service.engine.batch import PrefillBatch, build_batch
from service.engine.placement import OneDevice, Placement, RunnerSet, graph_sizes
from service.engine.runners import Chunks, on_stream, picked_rows, with_hidden, with_pooled
from service.engine.runners.breakable import BreakableRunner
from service.engine.runners.buckets import Buckets
from service.engine.runners.buffers import StaticBuffers
from service.engine.runners.capture import Graphs
from service.engine.runners.graph import CudaGraphBackend, SegmentBackend, tensor_bytes
from service.model.decoder import Activations, DecoderModel
from service.model.errors import ModelLoadError
from service.model.layers import MLP, gated_mlp
from service.model.loader import LoadedModel
from service.model.meta import KVCache
from service.model.quant.plain import Linear


class DPGroup:
    """This process's rank in the data-parallel group; `pg` None only for world size 1."""

    def __init__(self, rank: int = 0, world: int = 1, pg: dist.ProcessGroup | None = None,
                 comm_device: torch.device | str = "cpu"):
        assert 0 <= rank < world, f"rank {rank} outside world size {world}"
        assert pg is not None or world == 1, "world size > 1 needs a process group"
        self.rank, self.world, self.pg = rank, world, pg
        self.comm_device = torch.device(comm_device)
        self.backend = dist.get_backend(pg) if pg is not None else "none"

    def all_gather_counts(self, n: int) -> list[int]:
        if self.world == 1:
            return [n]
        mine = torch.tensor([n], dtype=torch.int64, device=self.comm_device)
        outs = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(outs, mine, group=self.pg)
        return [int(x.item()) for x in outs]

    def all_gather_rows(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """out (world·n, D) <- every rank's x (n, D), rank-major."""
        if self.backend == "nccl":
            dist.all_gather_into_tensor(out, x, group=self.pg)
        else:
            dist.all_gather(list(out.view(self.world, *x.shape).unbind(0)), x, group=self.pg)

    def reduce_scatter_rows(self, out: torch.Tensor, partial: torch.Tensor) -> None:
        """out (n, D) <- sum over ranks of partial (world·n, D), this rank's rows."""
        if self.backend == "nccl":
            dist.reduce_scatter_tensor(out, partial, group=self.pg)
        else:
            dist.all_reduce(partial, group=self.pg)
            out.copy_(partial.view(self.world, *out.shape)[self.rank])


def close_dp(group: DPGroup) -> None:
    """Leave the process group; NOTE: a barrier first, so no rank leaves mid-collective."""
    if group.pg is None:
        return
    dist.barrier(group=group.pg)
    dist.destroy_process_group(group.pg)


def init_dp(rank: int, world: int, backend: str, init_method: str) -> DPGroup:
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
    comm = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
    return DPGroup(rank, world, dist.group.WORLD, comm)


@dataclass(frozen=True)
class DPCaptureInputs:
    """The capture-only tensors in one int32 device tensor: [gather_len, n_0, ..., n_{w-1}]."""

    packed: torch.Tensor  # (world + 1,) int32

    @classmethod
    def new(cls, counts: list[int], rows: int, device: torch.device) -> DPCaptureInputs:
        return cls(torch.tensor([len(counts) * rows, *counts], dtype=torch.int32, device=device))

    @property
    def gather_len(self) -> torch.Tensor:
        return self.packed[:1]

    @property
    def global_num_tokens(self) -> torch.Tensor:
        return self.packed[1:]

    def fill(self, counts: list[int], rows: int) -> None:
        host = torch.tensor([len(counts) * rows, *counts], dtype=torch.int32)
        self.packed.copy_(host, non_blocking=False)

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.packed)


@dataclass(frozen=True)
class DPTokens:
    group: DPGroup
    rows: int  # each rank's rows in the gather
    inputs: DPCaptureInputs
    gathered: torch.Tensor | None = None  # (world·rows, D) static slice; None: allocate
    partial: torch.Tensor | None = None


def mask_padding(rows: torch.Tensor, dp: DPTokens) -> None:
    w, n = dp.group.world, dp.rows
    idx = torch.arange(w * n, device=rows.device, dtype=torch.int32).view(w, n)  # (w, n)
    local = idx - idx[:, :1]
    valid = (local < dp.inputs.global_num_tokens[:, None]) & (idx < dp.inputs.gather_len)
    rows.view(w, n, -1).masked_fill_(~valid[:, :, None], 0)


class DPStep:
    """Set by DPRunner before each forward and capture; read by every layer's DPMLP."""

    tokens: DPTokens | None = None


class DPMLP(nn.Module):
    def __init__(self, mlp: MLP, group: DPGroup, step: DPStep):
        super().__init__()
        inter = mlp.down_proj.in_features
        w, r = group.world, group.rank
        assert inter % w == 0, f"intermediate size {inter} not divisible by DP size {w}"
        f, lo = inter // w, r * (inter // w)
        gu, down = mlp.gate_up_proj.weight, mlp.down_proj.weight  # (2F, D), (D, F)
        self.gate_up_proj = Linear(gu.shape[1], 2 * f, bias=False, device="meta")
        self.down_proj = Linear(f, down.shape[0], bias=False, device="meta")
        with torch.no_grad():
            up = inter + lo
            shard_gu = gu if w == 1 else torch.cat([gu[lo : lo + f], gu[up : up + f]])
            shard_down = down if w == 1 else down[:, lo : lo + f].contiguous()
        self.gate_up_proj.weight = nn.Parameter(shard_gu, requires_grad=False)
        self.down_proj.weight = nn.Parameter(shard_down, requires_grad=False)
        self.group, self.step = group, step
        self.use_triton, self.activation = mlp.use_triton, mlp.activation

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None,
                scratch: torch.Tensor | None = None, qin: object = None) -> torch.Tensor:
        assert qin is None, "quantized projections are not sharded across data-parallel ranks"
        dp = self.step.tokens
        assert dp is not None, "a sharded (DP) MLP runs inside a DPRunner step"
        n, w = x.shape[0], self.group.world
        assert n == dp.rows, f"{n} rows, DP step has {dp.rows} per rank"
        gathered = x
        if w > 1:
            gathered = dp.gathered if dp.gathered is not None else x.new_empty(w * n, x.shape[1])
            self.group.all_gather_rows(gathered, x)
        mask_padding(gathered, dp)
        partial = out if w == 1 else dp.partial
        y = gated_mlp(gathered, self.gate_up_proj, self.down_proj, self.use_triton, partial,
                      scratch, activation=self.activation)
        if w == 1:
            return y
        res = out if out is not None else x.new_empty(n, x.shape[1])
        self.group.reduce_scatter_rows(res, y)
        return res


def shard_mlp(model: DecoderModel, group: DPGroup, step: DPStep) -> None:
    model.map_mlps(lambda mlp: mlp if isinstance(mlp, DPMLP) else DPMLP(mlp, group, step))


class DPRunner(BreakableRunner):
    """Graphs when the largest rank's batch fits a bucket, else eager; `backend` None: eager."""

    name = "dp"

    def __init__(self, model: DecoderModel, buckets: Buckets, backend: SegmentBackend | None,
                 group: DPGroup, stream: torch.cuda.Stream | None = None):
        super().__init__(model, buckets if backend is not None else Buckets(()),
                         backend or SegmentBackend(), stream)
        self.group, self.step = group, DPStep()
        shard_mlp(model, group, self.step)
        self.gathered = self.partial = None

    def allocate(self) -> StaticBuffers:
        w, m = self.group.world, self.buckets.largest
        width = self.model.mlp_width // w
        if w > 1:
            self.gathered = torch.zeros(w * m, self.cfg.hidden_size, dtype=self.dtype,
                                        device=self.device)
            self.partial = torch.zeros_like(self.gathered)
        return StaticBuffers.allocate(self.cfg, m, self.dtype, self.device, width, row_factor=w)

    def _tokens(self, n: int, inputs: DPCaptureInputs) -> DPTokens:
        w = self.group.world
        static = self.gathered is not None and n <= self.buckets.largest
        return DPTokens(self.group, n, inputs, self.gathered[: w * n] if static else None,
                        self.partial[: w * n] if static else None)

    def capture_inputs(self, n: int, v: Activations) -> DPCaptureInputs:
        inputs = DPCaptureInputs.new([n] * self.group.world, n, self.device)
        self.step.tokens = self._tokens(n, inputs)
        return inputs

    def can_run(self, chunks: Chunks, tokens: int) -> bool:
        return True  # every rank must take the same path: `run` decides after the counts

    @torch.inference_mode()
    def run(self, chunks: Chunks, kv: KVCache) -> tuple[torch.Tensor, PrefillBatch, str]:
        counts = self.group.all_gather_counts(sum(c.num_tokens for c in chunks))
        n = max(counts)
        graph = self.buckets.use_graph(n) and self.backend.has(self.buckets.pad_to_bucket(n))
        rows = self.buckets.pad_to_bucket(n) if graph else n
        with on_stream(self.stream):
            batch = build_batch(chunks, kv, self.device, pad_to=rows)
            picked = picked_rows(self.model, batch, chunks)
            if graph:
                inputs = self.backend.retained(rows)
                inputs.fill(counts, rows)
                self.step.tokens = self._tokens(rows, inputs)
                logits = self.forward(batch, picked)
                return logits, self.with_outputs(batch, picked, chunks), "graph"
            self.step.tokens = self._tokens(rows, DPCaptureInputs.new(counts, rows, self.device))
            if n == 0:
                return (torch.empty(0, self.cfg.vocab_size, device=self.device), batch,
                        "eager")
            h = self.model.hidden_states(batch.input_ids, batch.positions, batch.meta)
            logits = self.model.logits(h, batch.meta, picked)
            return logits, with_pooled(with_hidden(batch, picked), h, chunks), "eager"

    def _attend(self, batch: PrefillBatch, v: Activations):  # noqa: ANN202
        if batch.num_tokens == 0:  # a rank with no requests: padding rows only, no attention
            return lambda layer: None
        return super()._attend(batch, v)

    @property
    def retained_input_bytes(self) -> int:
        return self.backend.retained_bytes()


class DataParallel:
    """EngineCore's placement on a DP rank: one DPRunner, plain projections, norms unfolded."""

    warms_up = False  # a warm-up forward would need every rank

    def __init__(self, group: DPGroup):
        self.group = group

    def prepare(self, loaded: LoadedModel, cfg: EngineConfig) -> None:
        if loaded.model.quantized:
            raise ModelLoadError(f"{loaded.path}: {loaded.model.scheme.label} projections are not "
                                 "sharded across data-parallel ranks")

    def runners(self, model: DecoderModel, cfg: EngineConfig,
                stream: torch.cuda.Stream | None) -> RunnerSet:
        sizes = graph_sizes(cfg, stream)
        backend = CudaGraphBackend(stream) if sizes else None
        dp = DPRunner(model, Buckets(sizes), backend, self.group, stream)
        return (Graphs(dp) if sizes else None), [dp]


def placement(group: DPGroup | None) -> Placement:
    return OneDevice() if group is None else DataParallel(group)
