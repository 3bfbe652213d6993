"""extend_attention (Triton) against extend_attention_ref on awkward shapes; ref against math."""

import functools
import math
from dataclasses import replace

import pytest
import torch

from kernels.extend_attention import (
    INTERPRETER_CONFIG,
    AttnConfig,
    VarlenBatch,
    extend_attention,
    extend_attention_ref,
    prepare_extend_attention,
)
from kernels.kv_store import store_kv_ref

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

# (q_len, prefix_len, page_size, H, KVH, D, dtype): lengths 1/7/63/65/200, prefixes 0 and
# non-multiples of the page size, page sizes 1/16/64, GQA ratios 1/3/4/7, head_dim 64/128/80/96.
SINGLE_CASES = [
    (1, 0, 16, 4, 4, 64, F32),
    (1, 23, 16, 3, 1, 128, BF16),
    (7, 5, 1, 3, 1, 64, BF16),
    (63, 0, 16, 4, 1, 128, F32),
    (65, 37, 16, 7, 1, 64, BF16),
    (65, 64, 64, 2, 2, 64, F16),
    (200, 0, 64, 4, 2, 64, F32),
    (200, 130, 64, 8, 2, 128, BF16),
    (33, 100, 1, 6, 2, 80, F32),
    (17, 16, 16, 4, 4, 96, BF16),
]


def _config(device):
    return INTERPRETER_CONFIG if device == "cpu" else None


def _run_and_check(batch, dtype, device, close, config=None, max_prefix_len=None):
    out = batch.poisoned_out()
    o = extend_attention(*batch.args(max_prefix_len=max_prefix_len), out=out,
                         config=config or _config(device))
    ref = extend_attention_ref(*batch.args(torch.float32))
    n = batch.n_valid
    assert o.data_ptr() == out.data_ptr()
    close(o[:n].float(), ref[:n], dtype, "o")
    assert torch.isnan(o[n:]).all(), "padded tail rows must be left untouched"


@pytest.mark.parametrize("case", SINGLE_CASES, ids=lambda c: "-".join(map(str, c)))
def test_single_sequence(case, device, close, attn_batch):
    q_len, prefix, page_size, H, KVH, D, dtype = case
    batch = attn_batch([q_len], [prefix], page_size, H, KVH, D, dtype, device)
    _run_and_check(batch, dtype, device, close)
    # the same batch told its longest prefix: prefix-free batches take the kernel compiled
    # without the prefix loop, the others keep it
    _run_and_check(batch, dtype, device, close, max_prefix_len=prefix)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_mixed_batch_one_launch(dtype, device, close, attn_batch):
    """Different lengths and prefixes, an empty sequence, scattered pages, a padded tail."""
    qlens, plens = [1, 0, 63, 65, 200, 7], [0, 5, 17, 64, 0, 33]
    batch = attn_batch(qlens, plens, 16, 6, 2, 64, dtype, device, pad=5)
    _run_and_check(batch, dtype, device, close)


@pytest.mark.parametrize(
    "config",
    [
        AttnConfig(32, 16, 4, 1),
        AttnConfig(16, 16, 4, 1, use_tma=True, tma_min_tokens=0),
        AttnConfig(16, 16, 4, 1, heads_first=True, prefetch_pages=False),
    ],
    ids=str,
)
def test_config_variants(config, device, close, attn_batch):
    """BLOCK_M > BLOCK_N; TMA loads of the new tokens; the heads-first grid without page-id
    prefetch."""
    batch = attn_batch([40, 7, 70], [16, 9, 0], 16, 4, 1, 64, BF16, device, pad=3)
    _run_and_check(batch, BF16, device, close, config=config)


PACKED = AttnConfig(128, 16, 4, 1, pack_gqa=True)


@pytest.mark.parametrize("H, KVH", [(4, 1), (6, 2), (7, 1), (4, 4), (9, 1)], ids=str)
@pytest.mark.parametrize("heads_first", [False, True])
def test_packed_query_heads(H, KVH, heads_first, device, close, attn_batch):
    """pack_gqa: one program per KV head holds all its query heads (groups of 4, 3 and 7: 32,
    32 and 16 positions, full and padded tiles; groups of 1 and 9 run unpacked), with prefixes
    and a long diagonal."""
    cfg = replace(PACKED, heads_first=heads_first)
    batch = attn_batch([40, 7, 70, 1], [16, 9, 0, 33], 16, H, KVH, 64, BF16, device, pad=3)
    _run_and_check(batch, BF16, device, close, config=cfg)


def test_contiguous_inputs_and_explicit_scale(device, close, relerr, attn_batch):
    batch = attn_batch([19, 33], [3, 0], 16, 4, 2, 64, F32, device, fused=False)
    o = extend_attention(*batch.args(), sm_scale=0.3, config=_config(device))
    ref = extend_attention_ref(*batch.args(), sm_scale=0.3)
    close(o, ref, F32, "o")
    assert relerr(o, extend_attention_ref(*batch.args())) > 1e-3  # the scale is really used


def test_ref_matches_naive_math(attn_batch):
    """The oracle itself, in float64 against dense per-head softmax written out by hand, with
    query chunks that split sequences (3) and that do not (16)."""
    qlens, plens, ps, H, KVH, D = [5, 9], [7, 0], 4, 6, 2, 16
    batch = attn_batch(qlens, plens, ps, H, KVH, D, torch.float64, "cpu", fused=False)
    o = extend_attention_ref(*batch.args(), chunk_size=3)
    o_whole = extend_attention_ref(*batch.args(), chunk_size=16)
    start = 0
    for b, (n, P) in enumerate(zip(qlens, plens)):
        slots = [int(batch.page_table[b, j // ps]) * ps + j % ps for j in range(P)]
        keys = torch.cat([batch.k_cache[slots], batch.k[start : start + n]])
        vals = torch.cat([batch.v_cache[slots], batch.v[start : start + n]])
        for i in range(n):
            for h in range(H):
                kv = h // (H // KVH)
                s = keys[: P + i + 1, kv] @ batch.q[start + i, h] / math.sqrt(D)
                expect = torch.softmax(s, 0) @ vals[: P + i + 1, kv]
                assert torch.allclose(o[start + i, h], expect)
                assert torch.allclose(o_whole[start + i, h], expect)
        start += n


def test_no_tokens_is_a_no_op(device, attn_batch):
    batch = attn_batch([0, 0], [3, 0], 16, 2, 2, 64, F32, device, pad=2)
    out = batch.poisoned_out()
    extend_attention(*batch.args(), out=out, config=_config(device))
    assert torch.isnan(out).all()


def test_launcher_asserts(device, attn_batch):
    batch = attn_batch([5], [0], 16, 2, 2, 64, F32, device, fused=False)
    q, k, v, kc, vc, vb = batch.args()
    with pytest.raises(AssertionError, match="dtype"):
        extend_attention(q.to(torch.int32), k, v, kc, vc, vb)
    with pytest.raises(AssertionError, match="k is"):
        extend_attention(q, k.to(BF16), v, kc, vc, vb)
    with pytest.raises(AssertionError, match="contiguous"):
        extend_attention(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, kc, vc, vb)
    with pytest.raises(AssertionError, match="int32"):
        extend_attention(q, k, v, kc, vc, replace(vb, cu_seqlens_q=vb.cu_seqlens_q.long()))
    with pytest.raises(AssertionError, match="multiple"):
        extend_attention(q.repeat(1, 3, 1)[:, :3], k[:, :1].repeat(1, 2, 1), v, kc, vc, vb)


@pytest.mark.parametrize("H,KVH,D,dtype", [(4, 4, 64, F32), (7, 1, 64, BF16), (6, 2, 80, F32),
                                           (8, 2, 128, BF16)])
@pytest.mark.parametrize("packed", [False, True])
def test_fused_kv_store(H, KVH, D, dtype, packed, device, close, attn_batch):
    """store_slots: the same launch writes every new row's K and V to its slot (as store_kv_ref
    does) and the attention output is unchanged; slots of the prefix are never touched; with
    packed query heads, each KV head's program stores its rows."""
    qlens, plens = [1, 7, 65, 33], [0, 23, 37, 16]
    batch = attn_batch(qlens, plens, 16, H, KVH, D, dtype, device)
    n = batch.n_valid
    pt = batch.page_table.cpu()
    slots = torch.tensor([int(pt[b, pos // 16]) * 16 + pos % 16  # right after each prefix
                          for b, (q, p) in enumerate(zip(qlens, plens))
                          for pos in range(p, p + q)], device=device)
    want_k, want_v = batch.k_cache.clone(), batch.v_cache.clone()
    store_kv_ref(batch.k[:n], batch.v[:n], want_k, want_v, slots)
    out = batch.poisoned_out()
    q, k, v, kc, vc, vb = batch.args()
    launch, _ = prepare_extend_attention(q, k, v, kc, vc, vb, out=out,
                                         config=PACKED if packed else _config(device),
                                         store_slots=slots)
    launch(kc, vc)
    assert torch.equal(kc.nan_to_num(7.0), want_k.nan_to_num(7.0)), "k cache"
    assert torch.equal(vc.nan_to_num(7.0), want_v.nan_to_num(7.0)), "v cache"
    ref = extend_attention_ref(*batch.args(torch.float32))
    close(out[:n].float(), ref[:n], dtype, "o")


@pytest.mark.parametrize("H,KVH,D,dtype", [(4, 4, 64, F32), (6, 2, 128, BF16)])
def test_cache_addresses_read_at_launch(H, KVH, D, dtype, device, close, attn_batch):
    """cache_table: the kernel reads the caches' base addresses from memory at launch (what a
    captured graph replays), so rewriting the table moves it to another pool; a batch padded
    with empty sequences and a wider page table (a graph's fixed metadata shapes) is exact."""
    qlens, plens = [7, 65, 1], [23, 0, 16]
    batch = attn_batch(qlens, plens, 16, H, KVH, D, dtype, device)
    n = batch.n_valid
    q, k, v, kc, vc, vb = batch.args()
    cu, pl, pt = vb.cu_seqlens_q, vb.prefix_lens, vb.page_table
    pad = 3  # empty sequences after the live ones, and extra page-table columns
    cu_p = torch.cat([cu, cu[-1:].repeat(pad)])
    pl_p = torch.cat([pl, pl.new_zeros(pad)])
    pt_p = torch.zeros(pt.shape[0] + pad, pt.shape[1] + 5, dtype=pt.dtype, device=device)
    pt_p[: pt.shape[0], : pt.shape[1]] = pt
    ptc = pt.cpu()
    slots = torch.full((q.shape[0],), 0, dtype=torch.int64, device=device)
    slots[:n] = torch.tensor([int(ptc[b, pos // 16]) * 16 + pos % 16
                              for b, (ql, p) in enumerate(zip(qlens, plens))
                              for pos in range(p, p + ql)], device=device)
    other_k, other_v = kc.clone(), vc.clone()  # a second pool with the same prefix contents
    kc.fill_(float("nan"))  # the bound pool: reading it would poison the output
    table = torch.tensor([[kc.data_ptr()], [vc.data_ptr()]], dtype=torch.int64, device=device)
    out = batch.poisoned_out()
    padded = VarlenBatch(cu_p, pl_p, pt_p, vb.page_size, q.shape[0])
    launch, _ = prepare_extend_attention(
        q, k, v, kc, vc, padded, out=out, config=_config(device), store_slots=slots,
        cache_table=(table[0], table[1]))
    want_k, want_v = other_k.clone(), other_v.clone()
    store_kv_ref(k[:n], v[:n], want_k, want_v, slots[:n])
    table.copy_(torch.tensor([[other_k.data_ptr()], [other_v.data_ptr()]]))
    launch(table[0], table[1])
    assert torch.equal(other_k.nan_to_num(7.0), want_k.nan_to_num(7.0)), "k stored in the new pool"
    assert torch.equal(other_v.nan_to_num(7.0), want_v.nan_to_num(7.0)), "v stored in the new pool"
    ref = extend_attention_ref(q, k, v, other_k, other_v, vb)
    close(out[:n].float(), ref[:n].float(), dtype, "o")
    assert torch.isnan(out[n:]).all(), "padded rows untouched"


def test_config_tiers_follow_rows_and_prefix(monkeypatch):
    """The prefix-free tiers serve batches without a known cached prefix (full graphs bind
    none), the small tiers every batch, the table what neither covers."""
    from kernels import extend_attention_config as ec

    table, a, b, c = (ec.AttnConfig(m, 16, 4, 1) for m in (128, 16, 32, 64))
    monkeypatch.setattr(ec, "_entries", lambda *_: (table, ((256, a), (2048, b)), ((1024, c),)))
    pick = functools.partial(ec.pick_config, 64, torch.bfloat16, torch.device("cpu"))
    assert pick(100, 0) is a and pick(100, None) is a and pick(100, 16) is c
    assert pick(1024, 0) is b and pick(1024, 512) is c and pick(2048, None) is b
    assert pick(2049, 0) is table and pick(2048, 16) is table and pick() is table


def test_packed_tier_only_where_the_group_packs(monkeypatch):
    """A packed entry serves a prefix batch only when its tile holds >= 16 positions of the
    group's heads; otherwise the next tier does."""
    from kernels import extend_attention_config as ec

    table, small = ec.AttnConfig(128, 16, 4, 1), ec.AttnConfig(64, 16, 4, 1)
    packed = ec.AttnConfig(128, 64, 8, 3, pack_gqa=True)
    monkeypatch.setattr(ec, "_entries", lambda *_: (table, (), ((64, packed), (1024, small))))
    pick = functools.partial(ec.pick_config, 64, torch.bfloat16, torch.device("cpu"))
    assert pick(20, 1024, 4) is packed and pick(64, 16, 8) is packed
    assert pick(20, 1024, 1) is small and pick(20, 1024, 16) is small  # 128 // 16 < 16 positions
    assert pick(65, 1024, 4) is small
    assert ec.packing(packed, 4) == (4, 32) and ec.packing(packed, 3) == (3, 32)
    assert ec.packing(packed, 7) == (7, 16) and ec.packing(packed, 9) == (1, 128)
    assert ec.packing(small, 4) == (1, 64)


def test_hopper_kernel_loops_over_many_short_tiles():
    """Looping CTAs for sequences of <= LOOP_MAX_Q_LEN rows once a round of CTAs spans
    <= LOOP_MAX_DEPTHS tile depths, with two Q slots at D128 up to Q2_MAX_Q_LEN rows and always
    at D64 (there from D64_MIN_BLOCKS_PER_SM causal blocks an SM); else, at D128, one CTA per
    tile from MIN_Q_LEN rows a sequence; else the Triton kernel."""
    from kernels import extend_attention_sm90 as sm90

    loop, one, pick = sm90.SM90_LOOP_CONFIG, sm90.SM90_CONFIG, sm90.pick_sm90
    q2, q2_64 = sm90.SM90_LOOP_Q2_CONFIGS[128], sm90.SM90_LOOP_Q2_CONFIGS[64]
    assert loop.ctas == 0 and one.ctas is None and loop.q_slots == 1
    assert q2.ctas == q2_64.ctas == 0 and q2.q_slots == q2_64.q_slots == 2
    assert q2.stages == 2, "at D128 the second Q slot takes the third K/V stage's memory"
    assert pick(64, 32, 128, 132) is q2 and pick(32, 32, 256, 132) is q2
    assert pick(16, 32, 512, 132) is loop and pick(8, 32, 1024, 132) is loop
    assert pick(2, 32, 1024, 132) is loop and pick(4, 16, 512, 132) is loop  # 64 tiles a depth
    assert pick(1, 32, 1024, 132) is one  # 32 tiles a depth: a round spans 4 depths
    assert pick(8, 32, 2048, 132) is one  # deeper than 1,024 rows
    assert pick(2, 32, 1024, 512) is one  # more SMs: too few tiles a depth
    assert pick(9, 4, 500, 132) is None  # short, too few to loop: Triton
    assert pick(1, 32, 200, 132) is None
    assert pick(8, 32, 1024, 132, head_dim=64) is q2_64
    assert pick(64, 32, 256, 132, head_dim=64) is q2_64
    assert pick(64, 32, 128, 132, head_dim=64) is q2_64  # 2,048 blocks
    assert pick(128, 9, 128, 132, head_dim=64) is q2_64  # 1,152 blocks
    assert pick(64, 9, 128, 132, head_dim=64) is None  # 576 blocks: under 7 an SM
    assert pick(16, 9, 256, 132, head_dim=64) is None  # 16 x 9 x 3 = 432 blocks
    assert pick(8, 9, 512, 132, head_dim=64) is None  # 8 x 9 x 10 = 720 blocks
    assert pick(64, 32, 128, 512, head_dim=64) is None  # more SMs: too few blocks each
    assert pick(1, 32, 1024, 132, head_dim=64) is None  # and never takes one CTA a tile


# ---- sliding-window (local) attention ----------------------------------------------------------

# sequences: no prefix; a prefix longer than most windows, new rows starting inside it; a long
# prefix and a short chunk (q-blocks whose window lies wholly in the prefix's tail or past it)
WINDOW_BATCH = ([70, 33, 5, 40], [0, 50, 90, 7])


def _windowed_naive(batch, qlens, plens, window):
    """(n_valid, H, D) float64: dense softmax with the mask written out; query at absolute
    position i sees keys j with i - window < j <= i."""
    q, k, v, kc, vc = (x.cpu().double() for x in (batch.q, batch.k, batch.v, batch.k_cache,
                                                   batch.v_cache))
    group, ps, pt = q.shape[1] // k.shape[1], batch.page_size, batch.page_table.cpu()
    out, start = [], 0
    for b, (n, P) in enumerate(zip(qlens, plens)):
        pos = torch.arange(P)
        slots = pt[b, pos // ps].long() * ps + pos % ps
        keys = torch.cat([kc[slots], k[start : start + n]]).repeat_interleave(group, 1)
        vals = torch.cat([vc[slots], v[start : start + n]]).repeat_interleave(group, 1)
        i, j = P + torch.arange(n)[:, None], torch.arange(P + n)[None, :]
        seen = (j <= i) & (j > i - window)  # (n, P + n)
        s = torch.einsum("qhd,khd->hqk", q[start : start + n], keys) / math.sqrt(q.shape[2])
        p = torch.softmax(s.masked_fill(~seen, float("-inf")), -1)
        out.append(torch.einsum("hqk,khd->qhd", p, vals))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("window", [1, 3, 15, 16, 17, 40, 1000])
@pytest.mark.parametrize("config", [INTERPRETER_CONFIG, PACKED], ids=["unpacked", "packed"])
def test_sliding_window(window, config, device, close, attn_batch):
    """Windows of one key, under and over a block (15: a q-block's highest row's first key
    starts a block), and longer than every sequence (then equal to causal attention); fp32, so
    one misplaced key in one row fails the tolerance."""
    if device == "cuda" and config is INTERPRETER_CONFIG:
        config = None
    qlens, plens = WINDOW_BATCH
    batch = attn_batch(qlens, plens, 16, 8, 2, 64, F32, device, pad=3)
    n = batch.n_valid
    naive = _windowed_naive(batch, qlens, plens, window)
    ref = extend_attention_ref(*batch.args(), window=window)
    close(ref[:n].cpu(), naive, F32, "ref")
    facts = [{}]  # the position bound unknown: the windowed kernel whatever the window
    if window >= max(p + q for p, q in zip(plens, qlens)):
        close(ref[:n], extend_attention_ref(*batch.args())[:n], F32, "a window over everything")
        facts.append(dict(max_prefix_len=max(plens)))  # known: the causal kernel
    for fact in facts:
        out = batch.poisoned_out()
        extend_attention(*batch.args(**fact), out=out, config=config, window=window)
        close(out[:n].cpu().double(), naive, F32, f"o {fact}")
        assert torch.isnan(out[n:]).all(), "padded tail rows must be left untouched"


@pytest.mark.parametrize("H,KVH,D,config", [(4, 1, 256, INTERPRETER_CONFIG), (8, 2, 64, PACKED)],
                         ids=["d256", "packed"])
def test_sliding_window_fused_kv_store(H, KVH, D, config, device, close, attn_batch):
    """The fused store writes every new row once, also those no q-block's window reaches."""
    qlens, plens, window = [40, 9], [33, 20], 3
    batch = attn_batch(qlens, plens, 16, H, KVH, D, F32, device)
    n, pt = batch.n_valid, batch.page_table.cpu()
    slots = torch.tensor([int(pt[b, pos // 16]) * 16 + pos % 16
                          for b, (q, p) in enumerate(zip(qlens, plens))
                          for pos in range(p, p + q)], device=device)
    want_k, want_v = batch.k_cache.clone(), batch.v_cache.clone()
    store_kv_ref(batch.k, batch.v, want_k, want_v, slots)
    naive = _windowed_naive(batch, qlens, plens, window)
    out = batch.poisoned_out()
    q, k, v, kc, vc, vb = batch.args()
    launch, _ = prepare_extend_attention(q, k, v, kc, vc, vb, out=out, window=window,
                                         config=config if device == "cpu" else None,
                                         store_slots=slots)
    launch(kc, vc)
    assert torch.equal(kc.nan_to_num(7.0), want_k.nan_to_num(7.0)), "k cache"
    assert torch.equal(vc.nan_to_num(7.0), want_v.nan_to_num(7.0)), "v cache"
    close(out[:n].cpu().double(), naive, F32, "o")
