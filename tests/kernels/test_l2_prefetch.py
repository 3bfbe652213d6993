"""l2_prefetch: reads every word of its tensors exactly once and writes nothing."""

import pytest
import torch

from kernels import l2_prefetch as pf


def _words_xoring_to(target: int, sizes: list[int], gen: torch.Generator) -> list[torch.Tensor]:
    """Random int32 tensors whose words XOR to `target` all together."""
    ws = [torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, generator=gen)
          for n in sizes]
    acc = 0
    for w in ws:
        for x in w.tolist():
            acc ^= x & 0xFFFFFFFF
    fix = (acc ^ target) & 0xFFFFFFFF
    ws[-1][-1] ^= torch.tensor(fix if fix < 2**31 else fix - 2**32, dtype=torch.int32)
    return ws


@pytest.mark.parametrize("sizes,block", [([1000, 77, 3], 64), ([5], 16), ([64, 64, 64, 64], 64)])
def test_reads_every_word_once(sizes, block, device):
    """One program: the XOR of what it read equals the XOR of all the words only if it read
    each exactly once (tails and all); only then does it store to the sink."""
    gen = torch.Generator().manual_seed(0)
    ws = [w.to(device) for w in _words_xoring_to(pf._MAGIC, sizes, gen)]
    sink = torch.zeros(1, dtype=torch.int32, device=device)
    pf.l2_prefetch(ws, sink, block=block)
    assert sink.item() == pf._MAGIC


def test_writes_nothing_otherwise(device):
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(300, 7, generator=gen).to(torch.bfloat16).to(device)
    before = weight.clone()
    sink = torch.zeros(3, dtype=torch.int32, device=device)
    pf.l2_prefetch([pf.as_words(weight), pf.as_words(weight[:100])], sink, block=64)
    assert torch.equal(sink, torch.zeros_like(sink))
    assert torch.equal(weight, before)


def test_as_words_and_asserts(device):
    t = torch.zeros(5, 3, dtype=torch.bfloat16, device=device)  # 15 halves -> 7 words
    assert pf.as_words(t).shape == (7,) and pf.as_words(t).data_ptr() == t.data_ptr()
    with pytest.raises(AssertionError, match="contiguous"):
        pf.as_words(t.t())
    with pytest.raises(AssertionError, match="as_words"):
        pf.l2_prefetch([t], torch.zeros(1, dtype=torch.int32, device=device))
    with pytest.raises(AssertionError, match="1 to 4"):
        pf.l2_prefetch([pf.as_words(t)] * 5, torch.zeros(1, dtype=torch.int32, device=device))
