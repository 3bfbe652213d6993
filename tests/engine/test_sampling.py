"""First-token sampling and logprobs (fp32 log_softmax of the raw logits)."""

from __future__ import annotations

import pytest
import torch

from service.engine.sampling import SamplingParams, choose, next_token, prompt_logprobs


def logits(seed: int = 0, v: int = 97) -> torch.Tensor:
    return torch.randn(v, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_with_logprobs() -> None:
    x = logits()
    out = next_token(x, SamplingParams(top_logprobs=5))
    lp = torch.log_softmax(x, -1)
    assert out.token.id == int(x.argmax())
    assert out.token.logprob == pytest.approx(float(lp.max()), abs=1e-6)
    assert [t.id for t in out.top] == torch.topk(lp, 5).indices.tolist()
    assert next_token(x, SamplingParams()).top == []


def test_seed_reproducible_and_distribution() -> None:
    x = logits(1)
    p = SamplingParams(temperature=1.0, seed=123)
    assert len({next_token(x, p).token.id for _ in range(5)}) == 1
    draws = [next_token(x, SamplingParams(temperature=1.0, seed=s)).token.id for s in range(3000)]
    freq = torch.bincount(torch.tensor(draws), minlength=x.numel()).float() / len(draws)
    assert torch.allclose(freq, torch.softmax(x, -1), atol=0.03)


def test_top_k_and_top_p_restrict_support() -> None:
    x = logits(2)
    top3 = set(torch.topk(x, 3).indices.tolist())
    for s in range(50):
        assert choose(x, SamplingParams(temperature=2.0, top_k=3, seed=s), None) in top3
    probs = torch.softmax(x, -1)
    order = torch.argsort(probs, descending=True)
    nucleus = set(order[: int((torch.cumsum(probs[order], 0) < 0.5).sum()) + 1].tolist())
    for s in range(50):
        assert choose(x, SamplingParams(temperature=1.0, top_p=0.5, seed=s), None) in nucleus
    assert choose(x, SamplingParams(temperature=1.0, top_p=1e-6, seed=0), None) == int(x.argmax())
    assert SamplingParams(temperature=0.7, top_k=1).greedy


def test_reported_logprob_is_raw_distribution_when_sampling() -> None:
    x = logits(3)
    out = next_token(x, SamplingParams(temperature=0.3, seed=9))
    assert out.token.logprob == pytest.approx(float(torch.log_softmax(x, -1)[out.token.id]))


def test_prompt_logprobs_gather() -> None:
    rows = torch.stack([logits(s) for s in range(4)])
    targets = [5, 17, 0, 96]
    out = prompt_logprobs(rows, targets, 2)
    lp = torch.log_softmax(rows, -1)
    for i, p in enumerate(out):
        assert p.token.id == targets[i]
        assert p.token.logprob == pytest.approx(float(lp[i, targets[i]]), abs=1e-6)
        assert [t.id for t in p.top] == torch.topk(lp[i], 2).indices.tolist()
    assert prompt_logprobs(rows[:0], [], 3) == []


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_k=-1),
                                 dict(top_logprobs=21)])
def test_invalid_params_assert(bad) -> None:
    with pytest.raises(AssertionError):
        SamplingParams(**bad)
