"""Real-size checks on CUDA (bf16 against an fp32 reference): 32k tokens, a 64-prompt batch,
an 8k cached prefix, every table config, TMA, custom ops under opcheck and CUDA-graph capture."""

import dataclasses
import random

import pytest
import torch

from kernels import ops
from kernels.extend_attention import (
    extend_attention,
    extend_attention_ref,
    pick_config,
)
from kernels.extend_attention_config import CONFIGS, PREFIX_FREE_CONFIGS, SMALL_CONFIGS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
BF16 = torch.bfloat16


def _check(batch, close, config=None, chunk_size=4096):
    out = batch.poisoned_out()
    o = extend_attention(*batch.args(), out=out, config=config)
    ref = extend_attention_ref(*batch.args(torch.float32), chunk_size=chunk_size)
    n = batch.n_valid
    close(o[:n].float(), ref[:n], BF16, "o")
    assert torch.isnan(o[n:]).all(), "padded rows must stay untouched"


@pytest.mark.parametrize("D", [64, 128])
def test_single_32k_sequence(D, close, attn_batch):
    batch = attn_batch([32768], [0], 16, 32, 8, D, BF16, "cuda")
    _check(batch, close, chunk_size=2048)


@pytest.mark.parametrize("H,KVH,D", [(32, 8, 128), (9, 3, 64), (28, 4, 128)])
def test_batch_of_64_prompts_with_prefixes(H, KVH, D, close, attn_batch):
    rng = random.Random(H * 1000 + D)
    qlens = [rng.randint(1, 2000) for _ in range(64)]
    plens = [rng.choice([0, rng.randint(1, 1500)]) for _ in range(64)]
    qlens[5] = 0  # a sequence with no new tokens
    batch = attn_batch(qlens, plens, 16, H, KVH, D, BF16, "cuda", pad=13)
    _check(batch, close, chunk_size=1024)


@pytest.mark.parametrize("page_size", [1, 16, 64, 128])
@pytest.mark.parametrize("use_tma", [False, True])
@pytest.mark.parametrize("prefetch", [False, True])
def test_extend_on_8k_prefix(page_size, use_tma, prefetch, close, attn_batch):
    batch = attn_batch([1000, 333], [8192, 8001], page_size, 32, 8, 128, BF16, "cuda")
    cfg = dataclasses.replace(pick_config(128, BF16, batch.q.device), use_tma=use_tma,
                              tma_min_tokens=0, prefetch_pages=prefetch)  # fmt: skip
    _check(batch, close, config=cfg, chunk_size=512)


@pytest.mark.parametrize("D", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", [BF16, torch.float16, torch.float32])
def test_every_head_dim_and_dtype_compiles(D, dtype, close, attn_batch):
    # NOTE: fp32 at D > 64 spills registers; the launch then needs local memory, which the
    # caching allocator's reserve from earlier tests can leave the driver without
    torch.cuda.empty_cache()
    batch = attn_batch([300, 1, 129], [77, 0, 16], 16, 8, 2, D, dtype, "cuda", pad=4)
    out = batch.poisoned_out()
    o = extend_attention(*batch.args(), out=out)
    ref = extend_attention_ref(*batch.args(torch.float32))
    n = batch.n_valid
    # fp32 on the GPU runs its dots in full precision ("ieee"), so 1e-5 holds there too
    close(o[:n].float(), ref[:n], dtype, f"D={D} {dtype}")


TABLE = [(key, "table", cfg) for key, cfg in CONFIGS.items()] + [
    (key, f"{name} <= {bound}", cfg) for name, tiers in (("prefix-free", PREFIX_FREE_CONFIGS),
                                                         ("small", SMALL_CONFIGS))
    for key, entries in tiers.items() for bound, cfg in entries]


@pytest.mark.parametrize("key, tier, config", TABLE, ids=[f"{k}-{t}" for k, t, _ in TABLE])
def test_table_configs(key, tier, config, close, attn_batch):
    major, d_pad = key
    if torch.cuda.get_device_capability()[0] != major:
        pytest.skip("config for another GPU generation")
    batch = attn_batch([700, 64, 5], [100, 0, 3], 16, 8, 2, d_pad, BF16, "cuda", pad=2)
    _check(batch, close, config=config)


@pytest.mark.parametrize("prefix", [0, 1000])
def test_sliding_window_d256(prefix, close, relerr, attn_batch):
    """Gemma 3's local layers: 4 query heads on 1 KV head, head_dim 256, a 512-key window over
    3,000 new tokens, alone and after a 1,000-token paged prefix."""
    batch = attn_batch([3000], [prefix], 16, 4, 1, 256, BF16, "cuda")
    out = batch.poisoned_out()
    o = extend_attention(*batch.args(max_prefix_len=prefix, num_tokens=3000), out=out,
                         window=512)
    ref = extend_attention_ref(*batch.args(torch.float32), window=512)
    close(o.float(), ref, BF16, "o")
    assert relerr(o, extend_attention_ref(*batch.args(torch.float32))) > 0.1, "no window applied"


def test_sliding_window_packed_gqa_d128(close, attn_batch):
    """Query heads packed per KV head (the small tier's config) and the service's pick, the
    latter through ops and the registered op (window an int there, 0 for none)."""
    from kernels.extend_attention_config import PACKED

    batch = attn_batch([64, 700, 5], [1500, 600, 0], 16, 32, 8, 128, BF16, "cuda", pad=2)
    n, W = batch.n_valid, 512
    ref = extend_attention_ref(*batch.args(torch.float32), window=W)
    for how in ("packed", "ops", "op"):
        out = batch.poisoned_out()
        if how == "packed":
            extend_attention(*batch.args(), out=out, config=PACKED, window=W)
        elif how == "ops":
            ops.extend_attention(*batch.args(), out=out, window=W)
        else:
            torch.ops.prefill.extend_attention(*ops._attention_op_args(*batch.args(), None, out,
                                                                       window=W))
        close(out[:n].float(), ref[:n], BF16, how)
        assert torch.isnan(out[n:]).all(), f"{how}: padded rows must stay untouched"


def test_custom_ops_opcheck():
    x, w = torch.randn(5, 96, device="cuda", dtype=BF16), torch.randn(96, device="cuda", dtype=BF16)
    torch.library.opcheck(torch.ops.prefill.rms_norm.default, (x, w, 1e-6, torch.empty_like(x)))
    torch.library.opcheck(
        torch.ops.prefill.fused_add_rms_norm.default, (x.clone(), x.clone(), w, 1e-6)
    )
    torch.library.opcheck(
        torch.ops.prefill.act_and_mul.default, (x, torch.empty(5, 48, device="cuda", dtype=BF16))
    )
    summary = torch.empty(5, 2 + 2 * 20, dtype=torch.float64, device="cuda")
    torch.library.opcheck(torch.ops.prefill.logits_summary.default,
                          (x, 20, summary, torch.empty(5, 96, device="cuda")))


def test_graph_capture_of_dense_ops_and_attention(close, attn_batch):
    """No host sync inside any op: all of them capture into a CUDA graph and replay correctly."""
    batch = attn_batch([100, 37], [20, 0], 16, 4, 2, 64, BF16, "cuda")
    x = torch.randn(137, 256, device="cuda", dtype=BF16)
    w = torch.randn(256, device="cuda", dtype=BF16)
    out_norm = torch.empty_like(x)
    out_act = torch.empty(137, 128, device="cuda", dtype=BF16)
    out_attn = batch.poisoned_out()
    args = batch.args()

    logits = torch.randn(8, 128256, device="cuda", dtype=BF16)  # Llama-3's vocabulary
    summary = torch.empty(8, 2 + 2 * 20, dtype=torch.float64, device="cuda")

    def step():
        ops.rms_norm(x, w, 1e-6, out=out_norm)
        ops.act_and_mul(x, out=out_act)
        ops.extend_attention(*args, out=out_attn)
        ops.summarize_logits(logits, 20, out=summary)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step()  # warm-up compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    x.copy_(torch.randn_like(x))
    batch.q.copy_(torch.randn_like(batch.q))
    logits.copy_(4 * torch.randn_like(logits))
    graph.replay()
    torch.cuda.synchronize()
    close(out_norm.float(), ops.rms_norm(x.float(), w.float(), 1e-6, use_triton=False), BF16, "n")
    close(out_act.float(), ops.act_and_mul(x.float(), use_triton=False), BF16, "act")
    ref = extend_attention_ref(*batch.args(torch.float32))
    close(out_attn.float(), ref, BF16, "attention")
    ref = ops.summarize_logits(logits, 20, use_triton=False)
    assert torch.equal(summary[:, 0], ref[:, 0]), "greedy ids"
    assert (summary[:, 1:] - ref[:, 1:]).abs()[:, [0] + list(range(21, 41))].max() < 2e-5


def test_prepared_launches_relaunch_compiled_kernels_per_layer(close, attn_batch, monkeypatch):
    """A prepared break goes through Triton's JIT once per kernel, then relaunches the compiled
    kernels directly with each layer's caches: results equal the reference for every layer."""
    from kernels import extend_attention as ea
    from kernels import kv_store, launch
    from kernels.extend_attention_triton import _extend_attention_kernel

    b0 = attn_batch([100, 37, 1], [20, 0, 45], 16, 8, 2, 64, BF16, "cuda")
    q, k, v = b0.q, b0.k, b0.v

    def layer_cache(c):  # same page layout (NaN outside the prefixes), new values
        return torch.where(c.isnan(), c, torch.randn_like(c))
    caches = [(b0.k_cache, b0.v_cache)] + [(layer_cache(b0.k_cache), layer_cache(b0.v_cache))
                                           for _ in range(2)]
    assert launch.hooks_idle(), "a Triton launch hook is installed: every launch takes the JIT"
    launch.CACHE.clear()  # forget what earlier tests compiled
    jit_calls = []
    for fn in (_extend_attention_kernel, kv_store._store_kv_kernel):
        monkeypatch.setattr(fn, "run", lambda *a, _run=fn.run, **kw: (jit_calls.append(1),
                                                                      _run(*a, **kw))[1])
    out = b0.poisoned_out()
    attend, _ = ea.prepare_extend_attention(q, k, v, *caches[0], b0.meta(), out=out)
    slots = torch.arange(b0.T, device="cuda", dtype=torch.int64) + 5
    store = kv_store.prepare_store_kv(k, v, *caches[0], slots)
    for i, (kc, vc) in enumerate(caches):
        out.fill_(float("nan"))
        attend(kc, vc)
        ref = extend_attention_ref(q.float(), k.float(), v.float(), kc.float(), vc.float(),
                                   b0.meta())
        close(out.float(), ref, BF16, f"attention, layer {i}")
        sk, sv = torch.zeros_like(kc), torch.zeros_like(vc)
        store(sk, sv)
        assert torch.equal(sk[slots], k) and torch.equal(sv[slots], v), f"store, layer {i}"
    assert len(jit_calls) == 2, f"{len(jit_calls)} JIT launches for 2 kernels x 3 layers"
    # A later batch of other lengths specializes alike: it reuses the compiled kernel, no JIT.
    b1 = attn_batch([50, 20], [20, 10], 16, 8, 2, 64, BF16, "cuda")
    out1 = b1.poisoned_out()
    attend1, _ = ea.prepare_extend_attention(*b1.args(), out=out1)
    attend1(b1.k_cache, b1.v_cache)
    close(out1.float(), extend_attention_ref(*b1.args(torch.float32)), BF16, "next batch")
    assert len(jit_calls) == 2, "the next batch went through the JIT again"


def _count_binds(monkeypatch):
    """Counts the bindings of either attention kernel (what a cached launch skips)."""
    from kernels import extend_attention as ea
    from kernels import extend_attention_sm90 as sm90
    from kernels import launch

    launch.CACHE.clear()
    binds = []

    def counted(fn, name):
        def run(*args, **kwargs):
            binds.append(name)
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(ea, "_bind", counted(ea._bind, "triton"))
    monkeypatch.setattr(sm90, "prepare_sm90", counted(sm90.prepare_sm90, "sm90"))
    return binds


def test_repeated_one_call_reuses_its_launch_and_keeps_nothing_alive(close, attn_batch,
                                                                     monkeypatch):
    """extend_attention called again on the same q/k/v/metadata memory reuses the bound launch
    (new caches and outputs swapped in); anything else rebinds; the cache pins no caller memory."""
    import gc
    import weakref

    binds = _count_binds(monkeypatch)
    b = attn_batch([300, 64], [0, 0], 16, 8, 2, 128, BF16, "cuda")
    n = b.n_valid
    ref = extend_attention_ref(*b.args(torch.float32))
    first = extend_attention(*b.args(max_prefix_len=0))
    for out in (None, None, b.poisoned_out()):  # fresh outputs, and a caller-given one
        o = extend_attention(*b.args(max_prefix_len=0), out=out)
        assert o.data_ptr() != first.data_ptr()
        close(o[:n].float(), ref[:n], BF16, "repeat")
    assert len(binds) == 1, binds
    o = extend_attention(*b.args(max_prefix_len=0), sm_scale=0.1)  # another key
    assert len(binds) == 2, binds
    q2 = b.q.clone()  # equal values, other memory: rebinds
    extend_attention(q2, *b.args(max_prefix_len=0)[1:])
    assert len(binds) == 3, binds
    out = b.poisoned_out()  # a swapped tensor: held only during its launch
    extend_attention(*b.args(max_prefix_len=0), out=out)
    kept = weakref.ref(q2), weakref.ref(out)
    del q2, out
    gc.collect()
    assert kept[0]() is None, "the cache kept the caller's q alive"
    assert kept[1]() is None, "the cache kept the caller's output alive"


def test_repeated_one_call_of_tma_kernels_keeps_nothing_alive(close, attn_batch, monkeypatch):
    """The same reuse for launches through TMA descriptors (the Hopper kernel where it runs, the
    plain kernel with TMA forced): the kept launch holds descriptors over raw addresses only."""
    import gc
    import weakref

    from kernels.extend_attention_config import AttnConfig

    binds = _count_binds(monkeypatch)
    b = attn_batch([4200, 300], [0, 0], 16, 8, 2, 128, BF16, "cuda", pad=3)
    n = b.n_valid
    ref = extend_attention_ref(*b.args(torch.float32))
    tma = AttnConfig(128, 64, 8, 3, use_tma=True, tma_min_tokens=0)
    for facts, kw in ((dict(max_prefix_len=0, num_tokens=n), {}), ({}, dict(config=tma))):
        q = b.q.clone()
        args = (q, *b.args(**facts)[1:])
        binds.clear()
        for i in range(3):
            out = b.poisoned_out()
            extend_attention(*args, out=out, **kw)
            close(out[:n].float(), ref[:n], BF16, f"{facts} {kw}, call {i}")
            assert torch.isnan(out[n:]).all()
        assert len(binds) == 1, f"{facts} {kw}: rebound {binds}"
        kept = weakref.ref(q)
        del q, args
        gc.collect()
        assert kept() is None, f"{facts} {kw}: the kept launch holds the caller's q"


# ---- the Hopper (sm_90) kernel for prefix-free batches ------------------------------------------

def _sm90_or_skip():
    from kernels import extend_attention_sm90 as sm90

    if not (sm90.HAS_GLUON and torch.cuda.get_device_capability()[0] == 9):
        pytest.skip("needs Gluon and an sm_90 GPU")
    return sm90


SM90_CASES = [  # qlens, H, KVH, D: lengths 0/1/7/63/65/129/200/1000, GQA ratios 1/3/4/7;
    # top tiles of 1-64 rows (consumer 1 idle) and 65-128 rows, one and many blocks (513, 1000:
    # the ring wraps with consumer 1 idle / busy)
    ([1, 7, 63, 0, 65, 200, 129, 1000, 513], 8, 2, 128),
    ([random.Random(5).randint(1, 300) for _ in range(40)], 8, 2, 128),
    ([1000], 4, 4, 128),
    ([300, 17, 1], 12, 4, 64),
    ([777, 5], 7, 1, 64),
    ([4096], 16, 2, 128),
    ([100], 1, 1, 128),  # one tile: consumer 0's half diagonal is all it computes
]


@pytest.mark.parametrize("case", SM90_CASES,
                         ids=lambda c: f"{len(c[0])}seq-{c[1]}-{c[2]}-{c[3]}")
@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_sm90_kernel_against_reference(case, dtype, close, attn_batch):
    """Every config shape of the Hopper kernel on awkward varlen batches, padded NaN tail rows
    (never read with num_tokens given), strided q/k/v views of one fused buffer; with the KV
    store fused, every live token's K/V lands at its (shuffled) slot and nothing else is
    written."""
    sm90 = _sm90_or_skip()
    qlens, H, KVH, D = case
    b = attn_batch(qlens, [0] * len(qlens), 16, H, KVH, D, dtype, "cuda", pad=5)
    ref = extend_attention_ref(*b.args(torch.float32))
    n = b.n_valid
    G = sm90.Sm90Config
    # few CTAs looping over many tiles: rings and Q phases carried across tiles
    configs = [sm90.SM90_CONFIG, G(2, heads_first=False), G(ctas=3), G(2, False, ctas=5),
               G(ctas=0), G(2, ctas=3, q_slots=2), G(2, ctas=0, q_slots=2)]
    if D == 64:  # deeper rings fit beside a smaller Q
        configs += [G(5), G(5, ctas=2)]
    slots = torch.randperm(b.T + 7, device="cuda")[: b.T] + 2  # the pool: T + 9 slots
    for cfg in configs:
        for store in (False, True):
            out = b.poisoned_out()
            kc = torch.full((b.T + 9, KVH, D), float("nan"), dtype=dtype, device="cuda")
            vc = kc.clone()
            res = sm90.extend_attention_sm90(b.q, b.k, b.v,
                                             b.meta(max_prefix_len=0, num_tokens=n), out=out,
                                             config=cfg, store=(kc, vc, slots) if store else None)
            assert res.data_ptr() == out.data_ptr()
            close(out[:n].float(), ref[:n], dtype, f"o {cfg} store={store}")
            assert torch.isnan(out[n:]).all(), "padded rows must stay untouched"
            live = slots[:n] if store else slots[:0]
            assert torch.equal(kc[live], b.k[: live.numel()]), f"k cache {cfg}"
            assert torch.equal(vc[live], b.v[: live.numel()]), f"v cache {cfg}"
            rest = torch.ones(kc.shape[0], dtype=torch.bool, device="cuda")
            rest[live] = False
            assert torch.isnan(kc[rest]).all() and torch.isnan(vc[rest]).all(), (
                f"{cfg}: a slot no live token maps to was written")


def test_sm90_single_32k_sequence(close, attn_batch):
    sm90 = _sm90_or_skip()
    b = attn_batch([32768], [0], 16, 8, 2, 128, BF16, "cuda")
    out = sm90.extend_attention_sm90(b.q, b.k, b.v, b.meta(max_prefix_len=0, num_tokens=b.T))
    ref = extend_attention_ref(*b.args(torch.float32), chunk_size=2048)
    close(out.float(), ref, BF16, "o")


def test_sm90_is_what_prefix_free_batches_take(close, attn_batch, monkeypatch):
    """extend_attention and a prepared break (KV store included) pick the Hopper kernel for a
    large prefix-free D=128 batch when told so, and the plain kernel otherwise."""
    sm90 = _sm90_or_skip()
    from kernels import extend_attention as ea

    calls = []
    monkeypatch.setattr(sm90, "prepare_sm90", lambda *a, _p=sm90.prepare_sm90, **kw: (
        calls.append(1), _p(*a, **kw))[1])
    qlens = [random.randint(600, 1000) for _ in range(8)]  # >= SM90_MIN_TOKENS rows in all
    b = attn_batch(qlens, [0] * 8, 16, 8, 2, 128, BF16, "cuda")
    ref = extend_attention_ref(*b.args(torch.float32))
    o = extend_attention(*b.args(max_prefix_len=0, num_tokens=b.T))
    assert len(calls) == 1
    close(o.float(), ref, BF16, "one call")
    extend_attention(*b.args(num_tokens=b.T))  # prefix unknown: the plain kernel
    extend_attention(*b.args(max_prefix_len=0))  # row count unknown: the plain kernel
    assert len(calls) == 1
    short = attn_batch([500] * 9, [0] * 9, 16, 4, 2, 128, BF16, "cuda")  # 36 tiles a depth
    o = extend_attention(*short.args(max_prefix_len=0, num_tokens=short.T))
    assert len(calls) == 1, "a few sequences of < MIN_Q_LEN rows take the plain kernel"
    close(o.float(), extend_attention_ref(*short.args(torch.float32)), BF16, "short")
    for n, rows, D in ((64, 128, 128), (16, 512, 64), (32, 256, 64)):  # looping CTAs
        many = attn_batch([rows] * n, [0] * n, 16, 32, 8, D, BF16, "cuda")
        o = extend_attention(*many.args(max_prefix_len=0, num_tokens=many.T))
        close(o.float(), extend_attention_ref(*many.args(torch.float32)), BF16, f"{n} x {rows}")
    assert len(calls) == 4, "many short sequences take the looping Hopper kernel"
    slots = torch.arange(b.T, device="cuda", dtype=torch.int64) + 3
    out = b.poisoned_out()
    attend, _ = ea.prepare_extend_attention(*b.args(max_prefix_len=0, num_tokens=b.T), out=out,
                                            store_slots=slots)
    assert len(calls) == 5
    kc, vc = torch.zeros_like(b.k_cache), torch.zeros_like(b.v_cache)
    attend(kc, vc)
    close(out.float(), ref, BF16, "prepared break")
    assert torch.equal(kc[slots], b.k) and torch.equal(vc[slots], b.v), "the KV store"


# ---- QK-norm in apply_rope, GeLU-tanh in act_and_mul, a 262,144-id vocabulary ------------------

@pytest.mark.parametrize("T,H,KVH,D", [(4096, 32, 8, 128), (3000, 8, 4, 256), (777, 16, 8, 256)])
@pytest.mark.parametrize("folded", [False, True])
def test_apply_rope_qk_norm(T, H, KVH, D, folded, close):
    """Qwen3 / Gemma 3 QK-norm fused into the rotation, with and without the folded input norm
    and bias: bf16 against the fp32 reference."""
    from kernels.rope import apply_rope, apply_rope_ref, rope_cos_sin_cache

    width = (H + 2 * KVH) * D
    cache = rope_cos_sin_cache(D, 8192, 1e6).cuda()
    qkv = (2 * torch.randn(T, width, device="cuda")).to(BF16)
    pos = torch.randint(0, 8192, (T,), device="cuda")
    wq, wk = ((1 + 0.5 * torch.randn(D, device="cuda")).to(BF16) for _ in range(2))
    kw = dict(q_norm=wq, k_norm=wk, qk_eps=1e-6)
    if folded:
        kw.update(norm_rows=torch.randn(T, 2560, device="cuda", dtype=BF16), eps=1e-6,
                  bias=torch.randn(width, device="cuda", dtype=BF16))

    def views(x):
        return (x[:, :H * D].view(T, H, D), x[:, H * D:(H + KVH) * D].view(T, KVH, D),
                x[:, (H + KVH) * D:].view(T, KVH, D))

    ref = qkv.float()
    rq, rk, rv = views(ref)
    apply_rope_ref(rq, rk, pos, cache, v=rv if folded else None, **kw)
    got = qkv.clone()
    q, k, v = views(got)
    apply_rope(q, k, pos, cache, v=v if folded else None, **kw)
    for name, a, b in zip("qkv", views(got), views(ref)):
        close(a.float(), b, BF16, name)


@pytest.mark.parametrize("T,F", [(4096, 10240), (333, 15360)])  # Gemma 3 4B's and 12B's MLPs
@pytest.mark.parametrize("folded", [False, True])
def test_gelu_tanh_and_mul(T, F, folded, close):
    x = (3 * torch.randn(T, 2 * F, device="cuda")).to(BF16)
    h = torch.randn(T, 2560, device="cuda", dtype=BF16) if folded else None
    got = ops.act_and_mul(x, activation="gelu_tanh", norm_rows=h, eps=1e-6)
    ref = ops.act_and_mul(x.float(), activation="gelu_tanh", norm_rows=h, eps=1e-6,
                          use_triton=False)
    close(got.float(), ref, BF16, "gelu_tanh")


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_logits_summary_gemma3_vocabulary(dtype):
    """64 rows of 262,144 ids (Gemma 3's vocabulary), the largest bucket's first-token head."""
    V, k, B = 262144, 20, 64
    logits = (4 * torch.randn(B, V, device="cuda")).to(dtype)
    logits[3, [V - 1, 200000]] = 40.0  # a tie past 2^17: the lower id first
    logits_out = torch.full((B, V), float("nan"), device="cuda")
    got = ops.summarize_logits(logits, k, logits_out=logits_out)
    x = logits.double()
    ref = ops.summarize_logits(x.float(), k, use_triton=False)
    assert torch.equal(got[:, 0], ref[:, 0]), "greedy ids"
    lp = torch.log_softmax(x, dim=-1)
    assert (got[:, 1] - lp.max(-1).values).abs().max() < 2e-5, "greedy logprob"
    assert (got[:, 2 + k:] - lp.topk(k, -1).values).abs().max() < 2e-5, "top-k logprobs"
    ids = got[:, 2:2 + k].long()
    assert torch.equal(x.gather(1, ids), x.gather(1, ref[:, 2:2 + k].long())), "top-k logits"
    assert got[3, 0] == 200000 and got[3, 2:4].tolist() == [200000, V - 1]
    assert torch.equal(logits_out, logits.float()), "the fp32 copy of the logits"


def test_qk_norm_and_gelu_tanh_ops_opcheck():
    from kernels.rope import rope_cos_sin_cache

    x = torch.randn(5, 96, device="cuda", dtype=BF16)
    torch.library.opcheck(torch.ops.prefill.act_and_mul.default,
                          (x, torch.empty(5, 48, device="cuda", dtype=BF16), "gelu_tanh"))
    q, k = torch.randn(5, 4, 64, device="cuda", dtype=BF16), torch.randn(5, 2, 64, device="cuda",
                                                                        dtype=BF16)
    w = torch.rand(64, device="cuda", dtype=BF16) + 0.5
    cache = rope_cos_sin_cache(64, 16, 1e4).cuda()
    pos = torch.arange(5, device="cuda")
    torch.library.opcheck(torch.ops.prefill.apply_rope.default,
                          (q, k, pos, cache, None, None, 0.0, None, w, w.clone(), 1e-6))
