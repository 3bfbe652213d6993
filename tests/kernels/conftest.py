"""Fixtures for the kernel tests: the device the kernels run on and a tolerance-checked compare."""

import os
import sys
import zlib
from pathlib import Path

import pytest
import torch

# Same guard as tests/conftest.py, for runs rooted at tests/kernels.
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# The repo root must be importable (`import kernels`) even when pytest is not run with it on the
# path; pyproject's `pythonpath = ["."]` makes this a no-op.
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 1e-2}


@pytest.fixture
def device() -> str:
    """Where the Triton kernels run: the CPU under the interpreter, else the GPU."""
    if INTERPRET:
        return "cpu"
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    return "cuda"


def _relerr(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    """NaN never passes; ‖out − ref‖ / ‖ref‖ within the dtype's tolerance."""
    assert torch.isfinite(out).all(), f"{what}: non-finite values in the output"
    err = _relerr(out, ref)
    assert err <= TOLERANCE[dtype], f"{what}: relative error {err:.3g} > {TOLERANCE[dtype]}"


@pytest.fixture
def close():
    """close(out, ref, dtype, what): the tolerance check every kernel test uses."""
    return assert_close


@pytest.fixture
def relerr():
    return _relerr


@pytest.fixture(autouse=True)
def _seed(request) -> None:
    """A seed per test case: reproducible, different across cases (and parametrizations)."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


class AttnBatch:
    """A random varlen extend batch: pages scattered through a NaN-poisoned pool, optional padded
    tail rows (NaN) and q/k/v as strided views of one fused qkv buffer."""

    def __init__(self, qlens, plens, page_size, H, KVH, D, dtype, device, pad=0, fused=True):
        B, T = len(qlens), sum(qlens) + pad
        pages = [-(-(p + n) // page_size) for p, n in zip(plens, qlens)]
        num_pages = sum(pages) + 3  # page 0 (dummy) and two spares stay unused
        perm = (torch.randperm(num_pages - 1) + 1).tolist()
        self.page_table = torch.zeros((B, max(pages + [1])), dtype=torch.int32)
        for b, n in enumerate(pages):
            self.page_table[b, :n] = torch.tensor(perm[:n], dtype=torch.int32)
            perm = perm[n:]
        shape = (num_pages * page_size, KVH, D)
        self.k_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.v_cache = torch.full(shape, float("nan"), dtype=dtype)
        for b, P in enumerate(plens):  # only the cached prefix holds data
            pos = torch.arange(P)
            slots = self.page_table[b, pos // page_size].long() * page_size + pos % page_size
            self.k_cache[slots] = torch.randn((P, KVH, D)).to(dtype)
            self.v_cache[slots] = torch.randn((P, KVH, D)).to(dtype)
        width = (H + 2 * KVH) * D
        qkv = torch.randn((T, width + (8 if fused else 0))).to(dtype)
        qkv[T - pad :] = float("nan")  # padded rows must never be read
        q = qkv[:, : H * D].view(T, H, D)
        k = qkv[:, H * D : (H + KVH) * D].view(T, KVH, D)
        v = qkv[:, (H + KVH) * D : width].view(T, KVH, D)
        if not fused:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        cu = torch.tensor([0] + qlens, dtype=torch.int64).cumsum(0).to(torch.int32)
        self.q, self.k, self.v = (x.to(device) for x in (q, k, v))
        self.k_cache, self.v_cache = self.k_cache.to(device), self.v_cache.to(device)
        self.cu_seqlens_q = cu.to(device)
        self.prefix_lens = torch.tensor(plens, dtype=torch.int32, device=device)
        self.page_table = self.page_table.to(device)
        self.page_size, self.max_q_len, self.T, self.n_valid = (
            page_size,
            max(qlens + [0]),
            T,
            T - pad,
        )

    def meta(self, **facts):
        """The batch's VarlenBatch; `facts`: max_prefix_len, num_tokens."""
        from kernels.varlen import VarlenBatch

        return VarlenBatch(self.cu_seqlens_q, self.prefix_lens, self.page_table, self.page_size,
                           self.max_q_len, **facts)

    def args(self, dtype=None, **facts):
        """Positional args of extend_attention, (q, k, v, k_cache, v_cache, batch); float tensors
        cast to `dtype` if given."""
        cast = (lambda x: x.to(dtype)) if dtype is not None else (lambda x: x)
        return (*(cast(x) for x in (self.q, self.k, self.v, self.k_cache, self.v_cache)),
                self.meta(**facts))

    def poisoned_out(self):
        return torch.full_like(self.q, float("nan"), memory_format=torch.contiguous_format)


@pytest.fixture
def attn_batch():
    return AttnBatch


@pytest.fixture
def launch_hook():
    """A no-op Triton launch hook installed for the test (skipped where Triton keeps the hook
    as a plain attribute rather than a chain)."""
    from triton import knobs

    hook = knobs.runtime.launch_enter_hook
    if not hasattr(hook, "add"):
        pytest.skip("this Triton has no launch-hook chain")
    probe = lambda *a, **k: None  # noqa: E731
    hook.add(probe)
    yield probe
    hook.remove(probe)
