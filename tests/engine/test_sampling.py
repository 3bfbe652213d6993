"""First-token sampling and logprobs (fp32 log_softmax of the raw logits): the batched last-row
summary and the device-side prompt logprobs equal the per-row CPU computation they replace."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from service.engine.interface import (
    MAX_TOP_LOGPROBS,
    PositionLogprobs,
    SamplingParams,
    TokenLogprob,
)
from service.engine.sampling import (
    choose,
    last_rows,
    make_generator,
    named_rows,
    next_token,
    prompt_logprobs,
)


def logits(seed: int = 0, v: int = 97) -> torch.Tensor:
    return torch.randn(v, generator=torch.Generator().manual_seed(seed)) * 3


def first(x: torch.Tensor, params: SamplingParams) -> PositionLogprobs:
    """The first token of one (V,) row, through the batched summary as the engine computes it."""
    return next_token(x, last_rows(x[None])[0], params)


def old_next_token(x: torch.Tensor, params: SamplingParams) -> PositionLogprobs:
    """The per-row CPU computation the summary replaced."""
    lp = torch.log_softmax(x.float(), -1)
    tok = choose(x, params, None if params.greedy else make_generator(params.seed))
    vals, ids = torch.topk(lp, params.top_logprobs)
    return PositionLogprobs(TokenLogprob(tok, float(lp[tok])),
                            [TokenLogprob(int(i), float(v)) for i, v in zip(ids, vals)])


def old_prompt_logprobs(rows: torch.Tensor, targets: list[int], k: int) -> list[PositionLogprobs]:
    lp = torch.log_softmax(rows.float(), -1)
    vals, ids = torch.topk(lp, k, dim=-1)
    return [PositionLogprobs(TokenLogprob(t, float(lp[i, t])),
                             [TokenLogprob(int(a), float(b)) for a, b in zip(ids[i], vals[i])],
                             None, int((lp[i] > lp[i, t]).sum()) + 1)
            for i, t in enumerate(targets)]


def assert_same(got: PositionLogprobs, want: PositionLogprobs, tol: float = 1e-5) -> None:
    assert got.token.id == want.token.id
    assert got.token.logprob == pytest.approx(want.token.logprob, abs=tol)
    assert [t.id for t in got.top] == [t.id for t in want.top]
    assert [t.logprob for t in got.top] == pytest.approx([t.logprob for t in want.top], abs=tol)


def test_greedy_is_argmax_with_logprobs() -> None:
    x = logits()
    out = first(x, SamplingParams(top_logprobs=5))
    lp = torch.log_softmax(x, -1)
    assert out.token.id == int(x.argmax())
    assert out.token.logprob == pytest.approx(float(lp.max()), abs=1e-6)
    assert [t.id for t in out.top] == torch.topk(lp, 5).indices.tolist()
    assert first(x, SamplingParams()).top == []


def test_seed_reproducible_and_distribution() -> None:
    x = logits(1)
    p = SamplingParams(temperature=1.0, seed=123)
    assert len({first(x, p).token.id for _ in range(5)}) == 1
    draws = [first(x, SamplingParams(temperature=1.0, seed=s)).token.id for s in range(3000)]
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


@pytest.mark.parametrize("temperature", [1e-300, 1e-38, 1e-45, 5e-324])
def test_tiny_temperature_is_greedy(temperature) -> None:
    """Any temperature the schema accepts (> 0) gives a valid draw; tiny ones are the argmax."""
    x = logits(4) * 30
    for s in range(5):
        assert choose(x, SamplingParams(temperature=temperature, seed=s), None) == int(x.argmax())


@pytest.mark.parametrize("top_p", [1e-300, 1e-45, 5e-324])
def test_tiny_top_p_keeps_the_most_likely_token(top_p) -> None:
    x = logits(5)
    for t in (0.5, 1.0, 100.0):
        assert choose(x, SamplingParams(temperature=t, top_p=top_p, seed=1), None) == int(
            x.argmax())


def test_reported_logprob_is_raw_distribution_when_sampling() -> None:
    x = logits(3)
    out = first(x, SamplingParams(temperature=0.3, seed=9))
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


@pytest.mark.parametrize("b,v", [(1, 97), (5, 1009), (33, 4099), (3, 7)])
def test_last_rows_equal_per_row_cpu(b, v) -> None:
    """Every k from 0 to 20 (at most the vocab), B rows reduced at once, awkward vocab sizes."""
    rows = torch.randn(b, v, generator=torch.Generator().manual_seed(b * v)) * 4
    summary = last_rows(rows)
    assert len(summary) == b
    for x, s in zip(rows, summary):
        assert len(s.top) == min(MAX_TOP_LOGPROBS, v) and s.top[0].id == s.greedy.id
        for k in range(min(MAX_TOP_LOGPROBS, v) + 1):
            for p in (SamplingParams(top_logprobs=k), SamplingParams(0.8, top_k=1, top_logprobs=k)):
                assert_same(next_token(x, s, p), old_next_token(x, p))
    assert last_rows(rows[:0]) == []


def test_greedy_reads_only_the_summary() -> None:
    """Greedy never touches the logits row (a meta tensor has no data); sampling copies it."""
    x = logits(4)
    s = last_rows(x[None])[0]
    row = torch.empty(x.shape, device="meta")
    assert next_token(row, s, SamplingParams(top_logprobs=3)) == first(x, SamplingParams(
        top_logprobs=3))
    with pytest.raises(NotImplementedError):
        next_token(row, s, SamplingParams(temperature=1.0, seed=1))


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.6, top_k=5),
                                    dict(temperature=1.3, top_p=0.7),
                                    dict(temperature=0.9, top_k=40, top_p=0.9, top_logprobs=4)])
def test_seeded_sampling_unchanged(params) -> None:
    """A seed draws what `choose` draws on the CPU row; the logprob is the raw distribution's."""
    for seed in range(20):
        x = logits(100 + seed, v=1009)
        p = SamplingParams(seed=seed, **params)
        out = first(x, p)
        assert out.token.id == choose(x, p, make_generator(seed))
        assert_same(out, old_next_token(x, p))


@pytest.mark.parametrize("n,v,k", [(1, 97, 0), (7, 1009, 3), (30, 4099, 20), (600, 97, 2)])
def test_prompt_logprobs_unchanged(n, v, k) -> None:
    rows = torch.randn(n, v, generator=torch.Generator().manual_seed(n)) * 3
    targets = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(v)).tolist()
    assert prompt_logprobs(rows, targets, k) == old_prompt_logprobs(rows, targets, k)


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(temperature=float("nan")),
                                 dict(top_p=0), dict(top_k=-1), dict(top_k=1 << 64),
                                 dict(seed=-1), dict(seed=1 << 64), dict(top_logprobs=21)])
def test_invalid_params_raise(bad) -> None:
    """ValueError, not assert: the engine decodes these off its socket (msgspec turns the
    ValueError into a validation error of the message), also under `python -O`."""
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_last_row_alternatives_are_a_prefix_of_the_top_k() -> None:
    """LastRow keeps the summary row and builds only the alternatives asked for: every n gives
    the first n of the full top-k (clamped at k), the logprobs of log_softmax."""
    x = torch.stack([logits(s) for s in range(3)])
    lp = torch.log_softmax(x, -1)
    for row, want in zip(last_rows(x), lp):
        full = row.top
        assert [t.id for t in full] == torch.topk(want, MAX_TOP_LOGPROBS).indices.tolist()
        assert [t.logprob for t in full] == pytest.approx(
            torch.topk(want, MAX_TOP_LOGPROBS).values.tolist(), abs=1e-6)
        for n in (0, 1, 7, MAX_TOP_LOGPROBS, MAX_TOP_LOGPROBS + 5):
            assert row.top_n(n) == full[:n]


def test_named_rows_for_one_list_and_for_several() -> None:
    """The forward's batched reduction: row i's logprobs of its own list, padded with token 0
    when the lists differ in length."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(7, 50, generator=g)
    lp = torch.log_softmax(logits, -1)
    same = named_rows(logits, [1, 4, 6], [(3, 9)] * 3)
    torch.testing.assert_close(same, lp[[1, 4, 6]][:, [3, 9]])
    mixed = named_rows(logits, [0, 5], [(7,), (2, 49, 11)])
    torch.testing.assert_close(mixed[0], lp[0, [7, 0, 0]])
    torch.testing.assert_close(mixed[1], lp[5, [2, 49, 11]])


def test_repetition_penalty_is_transformers_on_the_prompt_tokens() -> None:
    """vLLM's (and transformers') repetition penalty over the prompt's tokens decides the greedy
    token; the reported logprob stays the raw one."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    x = logits(3)
    prompt = np.array([int(x.argmax()), 5, 5, 11], dtype=np.int32)  # the raw winner is in it
    for penalty in (1.3, 4.0, 0.5):
        want = RepetitionPenaltyLogitsProcessor(penalty)(
            torch.from_numpy(prompt.astype(np.int64))[None], x.double()[None].clone())[0]
        out = next_token(x, last_rows(x[None])[0], SamplingParams(repetition_penalty=penalty),
                         prompt)
        assert out.token.id == int(want.argmax())
        assert out.token.logprob == pytest.approx(
            float(torch.log_softmax(x.double(), -1)[out.token.id]), abs=1e-6)
    assert next_token(x, last_rows(x[None])[0], SamplingParams(repetition_penalty=4.0),
                      prompt).token.id != int(x.argmax())


def test_logit_bias_and_allowed_and_banned_tokens_decide_the_greedy_token() -> None:
    x = logits(4)
    row = last_rows(x[None])[0]
    low = int(x.argmin())
    assert next_token(x, row, SamplingParams(logit_bias=((low, 100.0),))).token.id == low
    allowed = (3, 7, 9)
    assert next_token(x, row, SamplingParams(allowed_token_ids=allowed)).token.id == max(
        allowed, key=lambda t: float(x[t]))
    top2 = torch.topk(x, 2).indices.tolist()
    assert next_token(x, row, SamplingParams(banned_token_ids=(top2[0],))).token.id == top2[1]


def test_min_p_never_draws_below_its_share_of_the_top_token() -> None:
    """Every draw with min_p keeps p >= min_p * p_max under the temperature's distribution, as
    transformers' MinPLogitsWarper keeps them; without min_p some draws fall below."""
    from transformers.generation.logits_process import MinPLogitsWarper

    x = logits(5, v=211)
    t, min_p = 1.5, 0.2
    kept = MinPLogitsWarper(min_p)(None, (x.double() / t)[None])[0] > float("-inf")
    drawn = {first(x, SamplingParams(temperature=t, min_p=min_p, seed=s)).token.id
             for s in range(300)}
    assert drawn and all(kept[d] for d in drawn)
    free = {first(x, SamplingParams(temperature=t, seed=s)).token.id for s in range(300)}
    assert any(not kept[d] for d in free)
