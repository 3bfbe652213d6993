"""kernels/launch.py on the CPU: the cache keys, the cache and the launcher's argument list (the
launches themselves need CUDA: tests/kernels/test_kernels_gpu.py)."""

import inspect

import pytest
import torch

from kernels.launch import LaunchCache, Relauncher, call_key, spec_key


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
        return spec_key(_kernel, dev, list(args), kw or dict(BLOCK=32))

    assert key(base, 32) == key(torch.zeros(64), 48)  # both aligned, both divisible by 16
    assert key(base, 32) != key(base[1:], 32)  # 4-byte offset: not 16-byte aligned
    assert key(base, 32) != key(base.double(), 32)  # dtype
    assert key(base, 16) != key(base, 17) != key(base, 1)  # divisibility, == 1
    assert key(base, 2**31 + 16) != key(base, 16)  # 64-bit int
    assert key(base, 0.5) == key(base, 2.0)  # floats: type only
    assert key(base, 16) != key(base, 16, BLOCK=64)  # constexprs by value
    assert key(base, 16, BLOCK=32) != key(base, 16, BLOCK=32, num_warps=8)  # launch options
    assert key(base, object()) is None  # e.g. a tensor descriptor: the JIT decides


def test_call_key_names_bound_tensors_by_memory_and_swapped_ones_by_layout():
    q, k, out = torch.zeros(8, 4), torch.zeros(8, 4), torch.zeros(8, 4)

    def key(q, k, out, *scalars):
        return call_key("op", (q, k), (out,), *scalars)

    assert key(q, k, out, 3) == key(q, k, out, 3)
    assert key(q, k, out, 3) == key(q, k, torch.zeros(8, 4), 3)  # a new output: same launch
    assert key(q, k, out, 3) == key(q.view(8, 4), k, out, 3)  # another view, same memory
    assert key(q, k, out, 3) != key(q, k, out, 4)  # a scalar
    assert key(q, k, out, 3) != key(q.clone(), k, out, 3)  # equal values, other memory
    assert key(q, k, out, 3) != key(k, q, out, 3)  # the same tensors in other places
    assert key(q, k, out, 3) != key(q[:4], k, out, 3)  # shape
    assert key(q, k, out, 3) != key(q.t(), k, out, 3)  # strides
    assert key(q, k, out, 3) != key(q, k, out.double(), 3)  # dtype
    misaligned = torch.zeros(33)[1:].view(8, 4)  # 4 bytes past a 16-byte boundary
    assert key(q, k, out, 3) != key(q, k, misaligned, 3)
    assert not any(isinstance(x, torch.Tensor) for x in key(q, k, out)), "keeps tensors alive"


def test_launch_cache_is_a_bounded_lru():
    cache = LaunchCache(size=2)
    cache.put(("a",), 1)
    cache.put(("b",), 2)
    assert cache.get(("a",)) == 1  # now the most recent
    cache.put(("c",), 3)
    assert cache.get(("b",)) is None and cache.get(("a",)) == 1 and cache.get(("c",)) == 3
    cache.put(None, 4)  # no key: nothing cached
    assert cache.get(None) is None
    cache.clear()
    assert cache.get(("a",)) is None


def test_launch_cache_answers_nothing_while_a_launch_hook_is_set(request):
    cache = LaunchCache()
    cache.put(("a",), 1)
    request.getfixturevalue("launch_hook")
    assert cache.get(("a",)) is None


def test_launch_cache_answers_again_without_a_hook():
    cache = LaunchCache()
    cache.put(("a",), 1)
    assert cache.get(("a",)) == 1


def test_detach_without_a_fast_path_changes_nothing(jit_fn):
    x = torch.zeros(8)
    r = Relauncher(jit_fn, (2,), (x, x, 8, 0.5, 16), dict(BLOCK=32), swap=(1,))
    assert r.detach() is False and r.args is not None  # never launched: nothing to keep
