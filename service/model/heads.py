"""Score heads: a sequence classifier's `score.weight`, or Qwen3-Reranker's yes/no LM-head rows."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from service.model.errors import ModelLoadError
from service.model.tokenizer import TextTokenizer

CLASSIFIER = "ForSequenceClassification"
# config.json's problem_type -> the activation vLLM applies (transformers' loss for that type);
# otherwise "classify": softmax over 2+ labels, sigmoid of one
ACTIVATIONS = {"regression": "identity", "multi_label_classification": "sigmoid"}


@dataclass(frozen=True)
class ScoreHead:
    kind: str  # classify | yes-no
    weight: torch.Tensor  # (labels, hidden) fp32
    labels: tuple[str, ...]
    pad_id: int | None = None  # transformers scores the last token that is not this one
    activation: str = "classify"  # classify | sigmoid | identity (ACTIVATIONS)


def is_classifier(raw: Mapping[str, Any]) -> bool:
    return any(str(a).endswith(CLASSIFIER) for a in raw.get("architectures") or [])


def _token(tokenizer: TextTokenizer, word: str, where: str) -> int:
    ids = tokenizer.encode(word, add_special=False)
    if len(ids) != 1:
        raise ModelLoadError(f"{where}: SCORE_HEAD=yes-no needs {word!r} as one token, got {ids}")
    return ids[0]


def score_head(mode: str, raw: Mapping[str, Any], tensors: Mapping[str, torch.Tensor],
               head_weight: torch.Tensor, tokenizer: TextTokenizer, where: str
               ) -> ScoreHead | None:
    """The head SCORE_HEAD asks for, or None."""
    if mode == "yes-no":
        # softmax over [no, yes] is sigmoid of the logits' difference: one row (vLLM's form)
        no, yes = (_token(tokenizer, w, where) for w in ("no", "yes"))
        w = head_weight.float()
        return ScoreHead("yes-no", (w[yes] - w[no])[None], ("yes",))
    if mode == "none" or not is_classifier(raw):
        return None
    if "score.weight" not in tensors:
        raise ModelLoadError(f"{where}: a {CLASSIFIER} checkpoint without 'score.weight'")
    w = tensors["score.weight"].float()
    if w.dim() != 2 or w.shape[1] != head_weight.shape[1]:
        raise ModelLoadError(f"{where}: 'score.weight' has shape {tuple(w.shape)}")
    names = {str(k): str(v) for k, v in (raw.get("id2label") or {}).items()}
    pad = raw.get("pad_token_id")
    labels = tuple(names.get(str(i), f"LABEL_{i}") for i in range(w.shape[0]))
    return ScoreHead("classify", w, labels, pad if isinstance(pad, int) else None,
                     ACTIVATIONS.get(raw.get("problem_type"), "classify"))


def head_info(head: ScoreHead | None) -> dict[str, Any]:
    return {} if head is None else dict(head=head.kind, labels=head.labels, pad_id=head.pad_id,
                                        activation=head.activation)
