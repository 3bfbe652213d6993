"""apply_rope (Triton) against apply_rope_ref; rope_cos_sin_cache against transformers' formulas."""

import math

import pytest
import torch

import kernels.ops  # noqa: F401  (registers torch.ops.prefill.*)
from kernels.rope import apply_rope, apply_rope_ref, rope_cos_sin_cache

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize(
    "T,H,KVH,D,dtype,pos_dtype",
    [
        (1, 4, 4, 64, torch.float32, torch.int64),
        (7, 9, 3, 64, torch.bfloat16, torch.int32),
        (65, 32, 8, 128, torch.float16, torch.int64),
        (5, 6, 2, 80, torch.float32, torch.int32),
    ],
)
def test_apply_rope_fused_views(T, H, KVH, D, dtype, pos_dtype, device, close):
    cache = rope_cos_sin_cache(D, 4096, 500000.0, LLAMA3)
    qkv = torch.randn((T, (H + 2 * KVH) * D)).to(dtype)
    positions = torch.randint(0, 4096, (T,), dtype=pos_dtype)
    ref = qkv.clone()
    ref_q, ref_k = apply_rope_ref(
        ref[:, : H * D].view(T, H, D),
        ref[:, H * D : (H + KVH) * D].view(T, KVH, D),
        positions,
        cache,
    )
    dev = qkv.to(device, copy=True)
    q, k = dev[:, : H * D].view(T, H, D), dev[:, H * D : (H + KVH) * D].view(T, KVH, D)
    apply_rope(q, k, positions.to(device), cache.to(device))
    close(q.cpu().float(), ref_q.float(), dtype, "q")
    close(k.cpu().float(), ref_k.float(), dtype, "k")
    assert torch.equal(dev[:, (H + KVH) * D :].cpu(), qkv[:, (H + KVH) * D :]), "v untouched"
    if dtype == torch.float32:  # the ref's formula against the complex-number definition
        half = D // 2
        x = qkv[:, : H * D].view(T, H, D).double()
        cs = cache[positions.long()].double()[:, None]
        z = torch.complex(x[..., :half], x[..., half:]) * torch.complex(
            cs[..., :half], cs[..., half:]
        )
        close(ref_q.double(), torch.cat([z.real, z.imag], -1), dtype, "complex rotation")


@pytest.mark.parametrize("T,H,KVH,D,hidden,dtype,bias", [
    (7, 9, 3, 64, 576, torch.bfloat16, False),
    (5, 6, 2, 80, 100, torch.float32, True),
])
def test_apply_rope_folded_norm(T, H, KVH, D, hidden, dtype, bias, device, close):
    """norm_rows: q, k, v scaled by each token's 1/rms of the residual row, bias added, then q
    and k rotated: the QKV of rms_norm(h) * g computed from h @ (W * g)^T."""
    eps = 1e-6
    cache = rope_cos_sin_cache(D, 512, 10000.0)
    width = (H + 2 * KVH) * D
    h = (3 * torch.randn(T, hidden)).to(dtype)
    g = (1 + 0.5 * torch.randn(hidden)).to(dtype)
    w = torch.randn(width, hidden).to(dtype) / hidden**0.5
    b_used = torch.randn(width).to(dtype) if bias else None
    positions = torch.randint(0, 512, (T,))
    raw = (h.float() @ (w.float() * g.float()).t()).to(dtype)
    # the unfolded chain in float64: norm, projection (+ bias), rotation of q and k
    normed = h.double() * torch.rsqrt(h.double().pow(2).mean(-1, keepdim=True) + eps)
    qkv = (normed * g.double()) @ w.double().t()
    if bias:
        qkv = qkv + b_used.double()
    want = qkv.clone()
    apply_rope_ref(want[:, :H * D].view(T, H, D), want[:, H * D:(H + KVH) * D].view(T, KVH, D),
                   positions, cache)

    def views(x):
        return (x[:, :H * D].view(T, H, D), x[:, H * D:(H + KVH) * D].view(T, KVH, D),
                x[:, (H + KVH) * D:].view(T, KVH, D))

    kw = dict(eps=eps)
    if bias:
        kw.update(bias=b_used)
    dev = raw.to(device, copy=True)
    q, k, v = views(dev)
    kd = {n: (t.to(device) if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
    apply_rope(q, k, positions.to(device), cache.to(device), v=v, norm_rows=h.to(device), **kd)
    close(dev.cpu().double(), want, dtype, "folded qkv")
    ref = raw.clone()
    rq, rk, rv = views(ref)
    apply_rope_ref(rq, rk, positions, cache, v=rv, norm_rows=h, **kw)
    close(ref.double(), want, dtype, "ref")


def _qkv_views(x, H, KVH, D):
    T = x.shape[0]
    return (x[:, :H * D].view(T, H, D), x[:, H * D:(H + KVH) * D].view(T, KVH, D),
            x[:, (H + KVH) * D:].view(T, KVH, D))


@pytest.mark.parametrize("T,H,KVH,D,dtype,folded,bias", [
    (5, 8, 2, 64, torch.float32, False, False),
    (7, 8, 2, 128, torch.bfloat16, True, True),  # Qwen3's head_dim, with the folded input norm
    (4, 8, 2, 256, torch.bfloat16, False, False),  # Gemma 3's head_dim
    (3, 8, 2, 256, torch.float32, True, False),
    (6, 9, 3, 80, torch.float16, True, True),
])
def test_apply_rope_qk_norm(T, H, KVH, D, dtype, folded, bias, device, close):
    """q_norm/k_norm: each q and k head RMS-normalised over its D elements (after the folded
    norm's scale and the bias), then rotated; v is never QK-normed. Against torch's rms_norm per
    head followed by the plain rotation."""
    eps, qk_eps = 1e-6, 1e-6
    cache = rope_cos_sin_cache(D, 512, 1e6)
    width = (H + 2 * KVH) * D
    raw = (2 * torch.randn(T, width)).to(dtype)
    h = (3 * torch.randn(T, 96)).to(dtype)
    b_used = torch.randn(width).to(dtype) if bias else None
    wq, wk = ((1 + 0.5 * torch.randn(D)).to(dtype) for _ in range(2))
    positions = torch.randint(0, 512, (T,))
    # the chain in float64: scale, bias, per-head rms norm of q and k, rotation of q and k
    want = raw.double()
    if folded:
        want = want * torch.rsqrt(h.double().pow(2).mean(-1, keepdim=True) + eps)
    if bias:
        want = want + b_used.double()
    wq_, wk_, wv_ = _qkv_views(want, H, KVH, D)
    wq_.copy_(torch.nn.functional.rms_norm(wq_, (D,), wq.double(), qk_eps))
    wk_.copy_(torch.nn.functional.rms_norm(wk_, (D,), wk.double(), qk_eps))
    apply_rope_ref(wq_, wk_, positions, cache)

    kw = dict(q_norm=wq, k_norm=wk, qk_eps=qk_eps)
    if folded:
        kw.update(norm_rows=h, eps=eps)
    if bias:
        kw.update(bias=b_used)
    dev = raw.to(device, copy=True)
    q, k, v = _qkv_views(dev, H, KVH, D)
    kd = {n: (t.to(device) if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
    apply_rope(q, k, positions.to(device), cache.to(device), v=v if folded else None, **kd)
    ref = raw.clone()
    rq, rk, rv = _qkv_views(ref, H, KVH, D)
    apply_rope_ref(rq, rk, positions, cache, v=rv if folded else None, **kw)
    for name, got in (("triton", dev.cpu()), ("ref", ref)):
        for part, g, w in zip("qkv", _qkv_views(got, H, KVH, D), _qkv_views(want, H, KVH, D)):
            close(g.double(), w, dtype, f"{name} {part}")
    if not folded:
        assert torch.equal(dev[:, (H + KVH) * D:].cpu(), raw[:, (H + KVH) * D:]), "v untouched"


def test_qk_norm_through_the_custom_op(device, close):
    """torch.ops.prefill.apply_rope (what torch.compile calls) takes the QK-norm weights."""
    T, H, KVH, D = 3, 4, 2, 64
    cache, pos = rope_cos_sin_cache(D, 16, 1e4).to(device), torch.arange(T, device=device)
    q, k = torch.randn(T, H, D, device=device), torch.randn(T, KVH, D, device=device)
    wq, wk = (torch.rand(D, device=device) + 0.5 for _ in range(2))
    want_q, want_k = apply_rope_ref(q.clone(), k.clone(), pos, cache, q_norm=wq, k_norm=wk,
                                    qk_eps=1e-6)
    torch.ops.prefill.apply_rope(q, k, pos, cache, q_norm=wq, k_norm=wk, qk_eps=1e-6)
    close(q, want_q, torch.float32, "q")
    close(k, want_k, torch.float32, "k")


def _hf_llama3_inv_freq(dim, base, s):
    """transformers' _compute_llama3_parameters, transcribed step by step."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    low_wl = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wl = s["original_max_position_embeddings"] / s["high_freq_factor"]
    out = []
    for f in inv_freq.tolist():
        wl = 2 * math.pi / f
        if wl < high_wl:
            out.append(f)
        elif wl > low_wl:
            out.append(f / s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wl - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"]
            )
            out.append((1 - smooth) * f / s["factor"] + smooth * f)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("scaling", [None, LLAMA3, {"rope_type": "default"}])
def test_cos_sin_cache(scaling):
    D, P, theta = 128, 300, 500000.0
    cache = rope_cos_sin_cache(D, P, theta, scaling)
    assert cache.shape == (P, D) and cache.dtype == torch.float32
    if scaling is not None and scaling["rope_type"] == "llama3":
        inv = _hf_llama3_inv_freq(D, theta, scaling)
    else:
        inv = 1.0 / (theta ** (torch.arange(0, D, 2).double() / D))
    ang = torch.arange(P).double()[:, None] * inv[None, :]
    expect = torch.cat([ang.cos(), ang.sin()], -1)
    assert (cache.double() - expect).abs().max() < 5e-4  # fp32 angles at position < 300


def test_unknown_scaling_raises():
    with pytest.raises(ValueError, match="not supported"):
        rope_cos_sin_cache(64, 16, 10000.0, {"rope_type": "yarn", "factor": 4.0})


def test_asserts(device):
    q = torch.randn(3, 2, 64, device=device)
    cache = rope_cos_sin_cache(64, 8, 1e4).to(device)
    pos = torch.zeros(3, dtype=torch.int64, device=device)
    with pytest.raises(AssertionError, match="contiguous"):
        apply_rope(q.transpose(1, 2).contiguous().transpose(1, 2), q.clone(), pos, cache)
    with pytest.raises(AssertionError):
        apply_rope(q, q.clone(), pos.float(), cache)
    with pytest.raises(AssertionError):
        apply_rope(q, q.clone(), pos, cache.double())
    w = torch.ones(64, device=device)
    with pytest.raises(AssertionError, match="together"):
        apply_rope(q, q.clone(), pos, cache, q_norm=w)
    with pytest.raises(AssertionError, match="QK-norm weight"):
        apply_rope(q, q.clone(), pos, cache, q_norm=w[:32], k_norm=w[:32])
