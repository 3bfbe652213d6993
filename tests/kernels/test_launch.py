"""kernels/launch.py on the CPU: the specialization key and the launcher's argument list (the
launches themselves need CUDA: tests/kernels/test_kernels_gpu.py)."""

import inspect

import pytest
import torch

from kernels.launch import LastLaunch, Relauncher, _spec_key


def _kernel(x_ptr, y_ptr, n, scale, stride, BLOCK: "tl.constexpr", FLAG: "tl.constexpr" = True):  # noqa: F821
    pass


@pytest.fixture
def jit_fn():
    """A real JITFunction (what @triton.jit gives without TRITON_INTERPRET), never launched."""
    from triton.runtime.jit import JITFunction

    return JITFunction(_kernel)


def test_values_are_every_parameter_in_signature_order(jit_fn):
    x, y = torch.zeros(8), torch.zeros(8)
    args, kwargs = (x, y, 8, 0.5, 16), dict(BLOCK=32, num_warps=4)
    r = Relauncher(jit_fn, (2,), args, kwargs, swap=(1,))
    want = inspect.signature(_kernel).bind(*args, BLOCK=32)
    want.apply_defaults()
    assert r._values(list(args)) == list(want.arguments.values())  # FLAG's default included


def test_spec_key_separates_what_triton_specializes():
    dev = torch.device("cpu")
    base = torch.zeros(64)

    def key(*args, **kw):
        return _spec_key(_kernel, dev, list(args), kw or dict(BLOCK=32))

    assert key(base, 32) == key(torch.zeros(64), 48)  # both aligned, both divisible by 16
    assert key(base, 32) != key(base[1:], 32)  # 4-byte offset: not 16-byte aligned
    assert key(base, 32) != key(base.double(), 32)  # dtype
    assert key(base, 16) != key(base, 17) != key(base, 1)  # divisibility, == 1
    assert key(base, 2**31 + 16) != key(base, 16)  # 64-bit int
    assert key(base, 0.5) == key(base, 2.0)  # floats: type only
    assert key(base, 16) != key(base, 16, BLOCK=64)  # constexprs by value
    assert key(base, 16, BLOCK=32) != key(base, 16, BLOCK=32, num_warps=8)  # launch options
    assert key(base, object()) is None  # e.g. a tensor descriptor: the JIT decides


def test_last_launch_hits_only_the_same_tensors_under_the_same_key():
    memo, value = LastLaunch(), object()
    q, k = torch.zeros(8), torch.zeros(8)
    memo.store(("key", 1), (q, k), value)
    assert memo.lookup(("key", 1), (q, k)) is value
    assert memo.lookup(("key", 2), (q, k)) is None  # another key
    assert memo.lookup(("key", 1), (q, torch.zeros(8))) is None  # an equal but other tensor
    assert memo.lookup(("key", 1), (k, q)) is None  # the same tensors in other places
    q.set_(torch.zeros(8))  # the same object, now over other memory
    assert memo.lookup(("key", 1), (q, k)) is None


def test_last_launch_keeps_no_tensor_alive():
    import gc
    import weakref

    memo, t = LastLaunch(), torch.zeros(8)
    memo.store(("key",), (t,), object())
    ref = weakref.ref(t)
    del t
    gc.collect()
    assert ref() is None


def test_detach_without_a_fast_path_changes_nothing(jit_fn):
    x = torch.zeros(8)
    r = Relauncher(jit_fn, (2,), (x, x, 8, 0.5, 16), dict(BLOCK=32), swap=(1,))
    assert r.detach() is False and r.args is not None  # never launched: nothing to keep
