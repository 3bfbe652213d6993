"""The attention seam hands the kernels the host-side facts that pick the Hopper kernel, unless
ATTENTION_HOPPER_KERNEL=false withholds them."""

import torch

from kernels import ops
from service.model.attention import AttentionBackend
from service.model.meta import ForwardMeta, KVCache
from tests.engine.helpers import tiny_cfg


def _meta(q_lens, prefix_lens, kvh=2, d=16, page_size=4):
    b = len(q_lens)
    cache = torch.zeros(64, kvh, d)
    cu = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    return ForwardMeta(cu, torch.tensor(prefix_lens, dtype=torch.int32),
                       torch.zeros((b, 4), dtype=torch.int32),
                       torch.zeros(sum(q_lens), dtype=torch.int64),
                       torch.zeros(b, dtype=torch.int64), tuple(q_lens), tuple(prefix_lens),
                       KVCache([cache], [cache.clone()], page_size))


def test_the_seam_passes_prefix_and_row_count_unless_switched_off(monkeypatch):
    seen = []
    monkeypatch.setattr(ops, "extend_attention", lambda q, k, v, kc, vc, batch, **kw: seen.append(
        (batch.max_prefix_len, batch.num_tokens)))
    backend = AttentionBackend("torch", tiny_cfg(num_layers=1, num_heads=4, num_kv_heads=2,
                                                         head_dim=16))
    qkv = torch.randn(7, (4 + 2 * 2) * 16)
    backend(0, qkv, _meta([3, 4], [0, 0]))
    backend(0, qkv, _meta([3, 4], [0, 5]))
    backend.hopper = False
    backend(0, qkv, _meta([3, 4], [0, 0]))
    assert seen == [(0, 7), (5, 7), (0, None)]


def test_the_switch_is_a_setting():
    from service.config import load_settings, resolve

    eng, _ = resolve(load_settings({"ATTENTION_HOPPER_KERNEL": "false"}), False)
    assert eng.attention_hopper_kernel is False
    assert resolve(load_settings({}), False)[0].attention_hopper_kernel is True
