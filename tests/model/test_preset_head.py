"""SCORE_HEAD applies to MODEL_PRESET's random weights, as to a checkpoint (bench/retrieval.py)."""

from pathlib import Path

import torch

from service.model.loader import load

TOKENIZER = Path(__file__).parent / "data" / "qwen3_reranker"


def test_preset_gets_the_yes_no_head():
    loaded = load(str(TOKENIZER), "smollm2-135m", torch.device("cpu"), torch.float32,
                  score="yes-no")
    head, w = loaded.model.score_head, loaded.model.head_weight.float()
    no, yes = (loaded.tokenizer.encode(x, add_special=False)[0] for x in ("no", "yes"))
    assert head is not None and head.kind == "yes-no" and head.labels == ("yes",)
    torch.testing.assert_close(head.weight, (w[yes] - w[no])[None])


def test_preset_without_head():
    loaded = load(str(TOKENIZER), "smollm2-135m", torch.device("cpu"), torch.float32)
    assert loaded.model.score_head is None
