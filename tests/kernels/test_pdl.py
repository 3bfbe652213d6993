"""Programmatic Dependent Launch: the switch and its flags (kernels/_triton.py), every kernel's
wait before its first load (compiled for sm_90 without a GPU), the KERNEL_PDL setting, and on a
GPU the kernels chained after cuBLAS GEMMs in a captured graph, bitwise equal with PDL off."""

import ast
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import _triton, activation, kv_store, linear, logits_summary, rope
from kernels import extend_attention as attn
from kernels import rms_norm as norm
from kernels._triton import pdl_enabled, pdl_flags, set_pdl
from kernels.launch import _spec_key

KERNELS = [norm._rms_norm_kernel, rope._apply_rope_kernel, activation._silu_and_mul_kernel,
           kv_store._store_kv_kernel, linear._indexed_linear_kernel, logits_summary._chunk_kernel,
           logits_summary._merge_kernel, attn._extend_attention_kernel]
ROOT = Path(__file__).resolve().parents[2]
BF16 = torch.bfloat16
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
needs_hopper = pytest.mark.skipif(not HOPPER, reason="needs a CUDA GPU of sm_90+ (PDL)")


@pytest.fixture
def restore_pdl():
    was = pdl_enabled()
    yield
    set_pdl(was)


def test_setter_round_trips(restore_pdl):
    set_pdl(False)
    assert pdl_enabled() is False
    set_pdl(True)
    assert pdl_enabled() is True


@pytest.mark.parametrize("on", [True, False])
def test_no_pdl_on_cpu(on, restore_pdl):
    set_pdl(on)
    assert pdl_flags(torch.device("cpu")) == dict(PDL=False)


def test_flags_follow_switch_and_capability(monkeypatch, restore_pdl):
    """A CUDA device of compute capability >= 9 gets the constexpr and the launch option
    together; an older one, or the switch off, neither (capabilities faked: no GPU needed)."""
    monkeypatch.setattr(_triton, "_INTERPRETED", False)
    monkeypatch.setattr(_triton, "_PDL_CAPABLE", {0: True, 1: False})
    hopper, ampere = torch.device("cuda", 0), torch.device("cuda", 1)
    set_pdl(True)
    assert pdl_flags(hopper) == dict(PDL=True, launch_pdl=True)
    assert pdl_flags(ampere) == dict(PDL=False)
    set_pdl(False)
    assert pdl_flags(hopper) == dict(PDL=False)


def test_interpreter_never_gets_pdl(monkeypatch, restore_pdl):
    if not _triton._INTERPRETED:
        pytest.skip("compiled kernels here: not the interpreter")
    monkeypatch.setattr(_triton, "_PDL_CAPABLE", {0: True})
    set_pdl(True)
    assert pdl_flags(torch.device("cuda", 0)) == dict(PDL=False)


def test_relauncher_key_separates_pdl_on_and_off():
    def k(x, y, n, BLOCK, PDL):  # noqa: N803
        pass

    x = torch.zeros(16)
    on = _spec_key(k, x.device, [x, x, 16], dict(BLOCK=32, PDL=True, launch_pdl=True))
    off = _spec_key(k, x.device, [x, x, 16], dict(BLOCK=32, PDL=False))
    assert on is not None and off is not None and on != off


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.fn.__name__)
def test_every_kernel_waits_first(kernel):
    """`PDL` is a constexpr parameter and `if PDL:` (gdc_wait, then gdc_launch_dependents) is
    the kernel's first statement, before anything can read a previous kernel's output."""
    tree = ast.parse(inspect.getsource(kernel.fn))
    fn = tree.body[0]
    params = {a.arg: a.annotation for a in fn.args.args}
    assert "PDL" in params and ast.unparse(params["PDL"]) == "tl.constexpr"
    first = fn.body[0]
    assert isinstance(first, ast.If) and ast.unparse(first.test) == "PDL", ast.unparse(first)
    calls = [ast.unparse(s.value) for s in first.body if isinstance(s, ast.Expr)]
    assert calls == ["tl.extra.cuda.gdc_wait()", "tl.extra.cuda.gdc_launch_dependents()"]


@pytest.fixture(scope="module")
def sm90_report() -> dict:
    """tests/kernels/sm90_ptx.py's facts: every kernel compiled for sm_90 (PTX and cubin, with
    Triton's bundled ptxas) through its own launcher's arguments, PDL on and off."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, str(ROOT / "tests/kernels/sm90_ptx.py")], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.fn.__name__)
def test_sm90_ptx_waits_before_the_first_load(kernel, sm90_report):
    facts = sm90_report[kernel.fn.__name__]
    on, off = facts["on"], facts["off"]
    assert on["launch_pdl"] and not off["launch_pdl"], "launch_pdl did not reach the metadata"
    assert 0 <= on["wait"] < on["dependents"] < on["first_load"], on
    assert off["wait"] == off["dependents"] == -1, "griddepcontrol compiled in without PDL"
    assert on["cubin"] > 0 and off["cubin"] > 0, "ptxas produced no cubin"


def test_kernel_pdl_is_a_setting():
    from service.config import load_settings, resolve

    eng, _ = resolve(load_settings({"KERNEL_PDL": "false"}), False)
    assert eng.kernel_pdl is False
    assert resolve(load_settings({}), False)[0].kernel_pdl is True


# ---- on a GPU ---------------------------------------------------------------------------------


def _chain(x: torch.Tensor, w: dict, pos: torch.Tensor, cs: torch.Tensor, H: int, KVH: int,
           D: int, b: dict) -> dict:
    """GEMM -> rms_norm -> GEMM -> rope -> silu_and_mul -> rms_norm -> GEMM, into buffers `b`."""
    torch.mm(x, w["in"], out=b["h"])  # (T, N)
    norm.rms_norm(b["h"], w["n1"], 1e-6, b["n"])
    torch.mm(b["n"], w["qkv"], out=b["qkv"])  # (T, (H + 2 KVH) D)
    qkv = b["qkv"]
    rope.apply_rope(qkv[:, : H * D].view(-1, H, D), qkv[:, H * D : (H + KVH) * D].view(-1, KVH, D),
                    pos, cs)
    activation.silu_and_mul(qkv, b["act"])  # (T, (H + 2 KVH) D / 2)
    norm.rms_norm(b["act"], w["n2"], 1e-6, b["n2"])
    torch.mm(b["n2"], w["out"], out=b["y"])
    return b


def _stage_refs(o: dict, w: dict, pos: torch.Tensor, cs: torch.Tensor, H: int, KVH: int,
                D: int) -> dict:
    """Each Triton stage's PyTorch reference, applied to the chain's own input of that stage."""
    qkv = o["n"] @ w["qkv"]  # rope's input again: the same cuBLAS GEMM of the same operands
    rope.apply_rope_ref(qkv[:, : H * D].view(-1, H, D),
                        qkv[:, H * D : (H + KVH) * D].view(-1, KVH, D), pos, cs)
    return dict(n=norm.rms_norm_ref(o["h"], w["n1"], 1e-6), qkv=qkv,
                act=activation.silu_and_mul_ref(o["qkv"]),
                n2=norm.rms_norm_ref(o["act"], w["n2"], 1e-6))


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("T", [7, 300])
@pytest.mark.usefixtures("restore_pdl")
def test_graph_with_pdl_equals_graph_without(T, close):
    """Triton kernels right after cuBLAS GEMMs and after each other, captured with PDL on and
    with it off: replays agree bitwise, and with the PyTorch references within bf16 tolerance."""
    dev, N, H, KVH, D = "cuda", 1024, 8, 2, 64
    width = (H + 2 * KVH) * D
    w = dict(**{k: torch.randn(a, b, device=dev, dtype=BF16) / a**0.5 for k, (a, b) in
                dict(out=(width // 2, N), qkv=(N, width), **{"in": (N, N)}).items()},
             n1=1 + 0.1 * torch.randn(N, device=dev, dtype=BF16),
             n2=1 + 0.1 * torch.randn(width // 2, device=dev, dtype=BF16))
    pos = torch.randint(0, 4096, (T,), device=dev, dtype=torch.int32)
    cs = rope.rope_cos_sin_cache(D, 4096, 5e5).to(dev)

    def capture(pdl: bool):
        set_pdl(pdl)
        assert pdl_flags(torch.device(dev)) == (dict(PDL=True, launch_pdl=True) if pdl
                                                else dict(PDL=False))
        x = torch.empty(T, N, device=dev, dtype=BF16)
        bufs = dict(h=torch.empty(T, N, device=dev, dtype=BF16),
                    n=torch.empty(T, N, device=dev, dtype=BF16),
                    qkv=torch.empty(T, width, device=dev, dtype=BF16),
                    act=torch.empty(T, width // 2, device=dev, dtype=BF16),
                    n2=torch.empty(T, width // 2, device=dev, dtype=BF16),
                    y=torch.empty(T, N, device=dev, dtype=BF16))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            x.normal_()
            _chain(x, w, pos, cs, H, KVH, D, bufs)  # compiles outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _chain(x, w, pos, cs, H, KVH, D, bufs)
        return graph, x, bufs

    with_pdl, without = capture(True), capture(False)
    for i in range(3):
        x = torch.randn(T, N, device=dev, dtype=BF16)
        outs = []
        for graph, xs, bufs in (with_pdl, without):
            xs.copy_(x)
            graph.replay()
            outs.append(bufs)
        torch.cuda.synchronize()
        for name in outs[0]:
            assert torch.equal(outs[0][name], outs[1][name]), f"replay {i}: {name} differs"
        for name, ref in _stage_refs(outs[0], w, pos, cs, H, KVH, D).items():
            close(outs[0][name].float(), ref.float(), BF16, f"replay {i}: {name}")


@pytest.mark.gpu
@needs_hopper
@pytest.mark.usefixtures("restore_pdl")
def test_compiled_kernels_wait_exactly_when_launched_with_pdl():
    """Whatever the JIT and the relauncher hold: a kernel launched with the PDL attribute has
    griddepcontrol.wait compiled in, and one without has none (so no launch can race)."""
    from triton.runtime.driver import driver

    from kernels import launch

    x = torch.randn(5, 96, device="cuda", dtype=BF16)
    k = torch.randn(5, 2, 64, device="cuda", dtype=BF16)
    cache = torch.zeros(64, 2, 64, device="cuda", dtype=BF16)
    slots = torch.arange(5, device="cuda", dtype=torch.int32)
    for on in (True, False):
        set_pdl(on)
        norm.rms_norm(x, torch.ones(96, device="cuda", dtype=BF16), 1e-6)
        kv_store.store_kv(k, k, cache, cache, slots)
    torch.cuda.synchronize()
    seen = set()
    for fn in (norm._rms_norm_kernel, kv_store._store_kv_kernel):
        for compiled in fn.device_caches[driver.active.get_current_device()][0].values():
            compiled = compiled.result() if hasattr(compiled, "result") else compiled
            pdl = bool(compiled.metadata.launch_pdl)
            assert ("griddepcontrol.wait" in compiled.asm["ptx"]) == pdl, fn.fn.__name__
            seen.add((fn.fn.__name__, pdl))
    assert {(n, p) for n in ("_rms_norm_kernel", "_store_kv_kernel") for p in (True, False)} <= seen
    for key, (launcher, _, _) in launch._COMPILED.items():  # the relauncher's direct launches
        assert bool(launcher.launch_pdl) == dict(key[-1]).get("launch_pdl", False), key
