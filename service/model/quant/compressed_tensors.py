"""llmcompressor's compressed-tensors FP8 checkpoints, each run as the FP8 scheme (fp8.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from service.model.quant import Scheme
from service.model.quant.fp8 import Fp8
from service.model.quant.fp8_linear import BLOCK

_FLOAT8 = {"num_bits": 8, "type": "float"}
# (weights' strategy, activations' strategy, dynamic) -> Fp8's activations
_PAIRS = {("channel", "token", True): "token", ("tensor", "token", True): "token",
          ("channel", "tensor", False): "tensor", ("tensor", "tensor", False): "tensor",
          ("block", "group", True): "group"}


def _float8(args: Mapping[str, Any]) -> bool:
    return all(args.get(k) == v for k, v in _FLOAT8.items()) and args.get("symmetric", True)


class CompressedTensors(Scheme):
    name = "compressed-tensors"

    def choose(self, qc: Mapping[str, Any], refuse: Callable[[str], Exception]) -> Fp8 | None:
        if qc.get("quant_method") != "compressed-tensors":
            return None
        groups = list((qc.get("config_groups") or {}).values())
        if qc.get("format") != "float-quantized" or len(groups) != 1:
            raise refuse(f"format {qc.get('format')!r} with {len(groups)} config groups")
        g = groups[0]
        w, a = g.get("weights") or {}, g.get("input_activations")
        blocks = w.get("strategy") != "block" or w.get("block_structure") == [BLOCK, BLOCK]
        if not (_float8(w) and not w.get("dynamic") and blocks
                and w.get("strategy") in ("channel", "tensor", "block")):
            raise refuse(f"weights {w}")
        if a is None:
            raise refuse("without input_activations (weight-only FP8)")
        acts = _PAIRS.get((w["strategy"], a.get("strategy"), bool(a.get("dynamic"))))
        grouped = a.get("strategy") != "group" or a.get("group_size") == BLOCK
        if not (_float8(a) and acts and grouped):
            raise refuse(f"input_activations {a} with {w['strategy']} weights")
        if set(g.get("targets") or ["Linear"]) != {"Linear"}:
            raise refuse(f"targets {g.get('targets')}")
        return Fp8(w["strategy"], acts, "weight_scale", tuple(qc.get("ignore") or ()))


SCHEME = CompressedTensors()
