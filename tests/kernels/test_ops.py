"""kernels.ops: dispatch (reference on CPU by default, Triton when asked) and the custom ops."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from kernels import ops
from kernels.extend_attention import extend_attention_ref
from kernels.rope import rope_cos_sin_cache

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU dispatch tests")


def _both(fn, make_args):
    """Runs fn on fresh copies of the args with the reference and with Triton."""
    return fn(*make_args(), use_triton=False), fn(*make_args(), use_triton=True)


def test_elementwise_ops_dispatch(close):
    x, w, res = torch.randn(5, 96), torch.randn(96), torch.randn(5, 96)
    close(
        *_both(lambda a, b, **kw: ops.rms_norm(a, b, 1e-6, **kw), lambda: (x, w)),
        torch.float32,
        "rms_norm",
    )
    (ax, ar), (bx, br) = _both(
        lambda a, b, **kw: ops.fused_add_rms_norm(a, b, w, 1e-6, **kw),
        lambda: (x.clone(), res.clone()),
    )
    close(bx, ax, torch.float32, "fused x")
    close(br, ar, torch.float32, "fused residual")
    h = torch.randn(3, 64)
    close(*_both(ops.act_and_mul, lambda: (h,)), torch.float32, "silu")
    assert torch.equal(ops.act_and_mul(x), ops.act_and_mul(x, use_triton=None))  # CPU -> ref


def test_rope_and_store_kv_dispatch(close):
    cache = rope_cos_sin_cache(64, 32, 1e4)
    qkv = torch.randn(6, 5 * 64)
    pos = torch.arange(6)
    views = lambda t: (t[:, :192].view(6, 3, 64), t[:, 192:256].view(6, 1, 64))
    (aq, ak), (bq, bk) = _both(
        lambda q, k, **kw: ops.apply_rope(q, k, pos, cache, **kw), lambda: views(qkv.clone())
    )
    close(bq, aq, torch.float32, "q")
    close(bk, ak, torch.float32, "k")
    k, v = torch.randn(6, 1, 64), torch.randn(6, 1, 64)
    slots = torch.tensor([3, 9, 4, 0, 0, 0])
    caches = [torch.zeros(12, 1, 64) for _ in range(4)]
    ops.store_kv(k, v, caches[0], caches[1], slots)
    ops.store_kv(k, v, caches[2], caches[3], slots, use_triton=True)
    assert torch.equal(caches[0][1:], caches[2][1:]) and torch.equal(caches[1][1:], caches[3][1:])


def test_extend_attention_dispatch(close, attn_batch):
    batch = attn_batch([5, 20], [3, 17], 16, 4, 2, 64, torch.float32, "cpu", pad=2)
    ref = ops.extend_attention(*batch.args())  # CPU tensors: the reference
    out = batch.poisoned_out()
    o = ops.extend_attention(*batch.args(max_prefix_len=17), out=out, use_triton=True)
    n = batch.n_valid
    assert o.data_ptr() == out.data_ptr()
    close(o[:n], ref[:n], torch.float32, "o")
    close(ref[:n], extend_attention_ref(*batch.args())[:n], torch.float32, "ops ref")


def test_traced_code_calls_the_custom_ops(close, attn_batch, monkeypatch):
    """Under torch.compile the dispatcher calls torch.ops.prefill.* (the VarlenBatch unpacked
    into tensors for extend_attention); here with is_compiling forced, on the interpreter."""
    from torch.library import wrap_triton

    from kernels import extend_attention as attn

    seen = []
    real = attn.extend_attention  # what the op's body calls, with wrap_triton
    monkeypatch.setattr(attn, "extend_attention",
                        lambda *a, **kw: (seen.append((a[5], kw["wrap"])), real(*a, **kw))[1])
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    batch = attn_batch([9, 30], [5, 0], 16, 4, 2, 64, torch.float32, "cpu", pad=1)
    o = ops.extend_attention(*batch.args(max_prefix_len=5), out=batch.poisoned_out(),
                             use_triton=True)
    n = batch.n_valid
    (vb, wrap), = seen
    assert wrap is wrap_triton and vb.max_prefix_len == 5 and vb.max_q_len == batch.max_q_len
    close(o[:n], extend_attention_ref(*batch.args())[:n], torch.float32, "attention op")
    x, w = torch.randn(5, 96), torch.randn(96)
    close(ops.rms_norm(x, w, 1e-6, use_triton=True), ops.rms_norm(x, w, 1e-6), torch.float32,
          "rms_norm op")


def test_custom_ops_run_the_kernels(close, attn_batch):
    """The ops themselves (what torch.compile calls), on the interpreter."""
    x, w = torch.randn(5, 96), torch.randn(96)
    out = torch.full_like(x, float("nan"))
    torch.ops.prefill.rms_norm(x, w, 1e-6, out)
    close(out, ops.rms_norm(x, w, 1e-6), torch.float32, "rms_norm op")
    batch = attn_batch([9, 30], [5, 0], 16, 4, 2, 64, torch.float32, "cpu", pad=1)
    o = batch.poisoned_out()
    torch.ops.prefill.extend_attention(batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache,
                                       batch.cu_seqlens_q, batch.prefix_lens, batch.page_table,
                                       batch.page_size, batch.max_q_len, 0.125, o)
    n = batch.n_valid
    close(o[:n], extend_attention_ref(*batch.args(), 0.125)[:n], torch.float32, "attention op")


def test_custom_ops_registered_with_fakes():
    for name in (
        "rms_norm",
        "fused_add_rms_norm",
        "apply_rope",
        "act_and_mul",
        "store_kv",
        "extend_attention",
        "logits_summary",
    ):
        assert hasattr(torch.ops.prefill, name), name
    with FakeTensorMode():  # shape propagation without running a kernel
        x = torch.empty(4, 64)
        out = torch.empty(4, 64)
        torch.ops.prefill.rms_norm(x, torch.empty(64), 1e-6, out)
        torch.ops.prefill.act_and_mul(torch.empty(4, 128), out)


def test_opcheck_rms_norm():
    # NOTE: the AOT-dispatch checks trace through wrap_triton, which the interpreter cannot do on
    # fake tensors; tests/kernels/test_kernels_gpu.py runs the full opcheck on CUDA.
    x, w, out = torch.randn(3, 32), torch.randn(32), torch.empty(3, 32)
    torch.library.opcheck(
        torch.ops.prefill.rms_norm.default,
        (x, w, 1e-6, out),
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )


def test_launch_hooks_idle_tracks_triton_hook_chain(request):
    """The relauncher's fast path is on only while no Triton launch hook is installed (Triton
    3.6 keeps an empty HookChain, never None)."""
    from kernels.launch import hooks_idle

    assert hooks_idle()
    request.getfixturevalue("launch_hook")
    assert not hooks_idle()
