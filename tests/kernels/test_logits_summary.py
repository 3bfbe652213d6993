"""logits_summary (Triton, two launches) against logits_summary_ref (log_softmax, argmax, topk)."""

import pytest
import torch

from kernels import ops
from kernels.logits_summary import logits_summary, logits_summary_ref


def _check(got: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, k: int) -> None:
    """Values to fp32 precision; ids exactly where the values decide them, and on ties the
    listed ids must carry the listed logits, all distinct."""
    assert torch.isfinite(got).all(), "non-finite values in the summary"
    x = x.float().cpu()
    got, ref = got.cpu(), ref.cpu()
    assert torch.equal(got[:, 0], ref[:, 0]), "greedy id differs from torch.argmax"
    assert (got[:, 1] - ref[:, 1]).abs().max() <= 2e-5, "greedy logprob"
    assert (got[:, 2 + k:] - ref[:, 2 + k:]).abs().max() <= 2e-5, "top-k logprobs"
    ids = got[:, 2:2 + k].long()
    assert torch.equal(x.gather(1, ids), x.gather(1, ref[:, 2:2 + k].long())), "top-k logits"
    assert all(len(set(r.tolist())) == k for r in ids), "a top-k id repeats"


@pytest.mark.parametrize(
    "B,V,k,dtype",
    [
        (1, 7, 7, torch.float32),  # k == V: every token
        (2, 4097, 20, torch.bfloat16),  # a 1-element last chunk
        (3, 5000, 5, torch.float16),
        (8, 49152, 20, torch.bfloat16),  # SmolLM2's vocabulary, 8 rows (a full graph's head)
        (1, 151936, 20, torch.float32),  # Qwen2.5's
    ],
)
def test_against_reference(B, V, k, dtype, device):
    x = (4 * torch.randn(B, V)).to(dtype)
    out = torch.full((B, 2 + 2 * k), float("nan"), dtype=torch.float64, device=device)
    logits_out = torch.full((B, V), float("nan"), device=device)
    got = logits_summary(x.to(device), k, out, logits_out)
    assert got.data_ptr() == out.data_ptr()
    _check(got, logits_summary_ref(x, k), x, k)
    assert torch.equal(logits_out.cpu(), x.float()), "the fp32 copy of the logits"


def _summary_f64(x: torch.Tensor, k: int) -> torch.Tensor:
    """logits_summary_ref's packing from a float64 log_softmax: at 262,144 ids the CPU's fp32
    log_softmax drifts by ~2e-5, past _check's tolerance (the kernel stays within 1e-6)."""
    lp = torch.log_softmax(x.double(), dim=-1)
    ids = torch.argmax(x.float(), dim=-1, keepdim=True)
    vals, top = torch.topk(lp, k, dim=-1)
    return torch.cat([ids.double(), lp.gather(-1, ids), top.double(), vals], dim=-1)


def test_gemma3_vocabulary(device):
    """262,144 ids (Gemma 3's): 64 chunks and 64 * k candidates a row; the best logits at the
    vocabulary's last id and past 2^17, tied, so the lower id comes first."""
    V, k = 262144, 4
    x = (4 * torch.randn(3, V)).to(torch.bfloat16)
    x[1, [V - 1, 200000]] = 30.0
    x[2, V - 1] = 30.0
    out = torch.full((3, 2 + 2 * k), float("nan"), dtype=torch.float64, device=device)
    logits_out = torch.full((3, V), float("nan"), device=device)
    got = logits_summary(x.to(device), k, out, logits_out)
    _check(got, _summary_f64(x, k), x, k)
    assert torch.equal(logits_out.cpu(), x.float()), "the fp32 copy of the logits"
    got = got.cpu()
    assert torch.equal(got[:, 0], logits_summary_ref(x, k)[:, 0])
    assert got[1, 0] == 200000 and got[1, 2:4].tolist() == [200000, V - 1]
    assert got[2, 0] == V - 1 and got[2, 2] == V - 1


def test_ties_go_to_the_lowest_id(device):
    x = torch.zeros(2, 300)
    x[0, [250, 40, 260]] = 3.0  # three-way tie for the best
    x[1, 299] = -1.0  # everything else ties at 0
    out = torch.empty(2, 2 + 2 * 4, dtype=torch.float64, device=device)
    logits_summary(x.to(device), 4, out)
    out = out.cpu()
    assert out[0, 0] == 40 and out[0, 2:6].tolist() == [40, 250, 260, 0]
    assert out[1, 0] == 0 and out[1, 2:6].tolist() == [0, 1, 2, 3]
    lse = torch.logsumexp(x.double(), dim=-1)
    assert abs(out[1, 1] - (0 - lse[1])) < 1e-5


def test_nan_rows_keep_ids_in_the_vocabulary(device):
    x = torch.randn(2, 5000)
    x[1] = float("nan")
    out = torch.empty(2, 2 + 2 * 5, dtype=torch.float64, device=device)
    logits_summary(x.to(device), 5, out)
    ids = out.cpu()[:, [0, 2, 3, 4, 5, 6]]
    assert ((ids >= 0) & (ids < 5000)).all()
    assert torch.isfinite(out[0].cpu()).all() and torch.isnan(out[1, 1].cpu())


def test_dispatch_picks_reference_on_cpu():
    x = torch.randn(2, 100)
    out = ops.summarize_logits(x, 3, use_triton=False)
    assert torch.equal(out, logits_summary_ref(x, 3))


def test_asserts(device):
    x = torch.randn(2, 10, device=device)
    out = torch.empty(2, 6, dtype=torch.float64, device=device)
    with pytest.raises(AssertionError, match="k=11"):
        logits_summary(x, 11, torch.empty(2, 24, dtype=torch.float64, device=device))
    with pytest.raises(AssertionError, match="last dim"):
        logits_summary(torch.randn(10, 2, device=device).t(), 2, out)
    with pytest.raises(AssertionError):
        logits_summary(x, 2, out.float())
