"""store_kv (Triton) against store_kv_ref: scattered slots, dummy slot 0 for padding, views."""

import pytest
import torch

from kernels.kv_store import store_kv, store_kv_ref


@pytest.mark.parametrize(
    "T,KVH,D,dtype,slot_dtype",
    [
        (1, 1, 64, torch.float32, torch.int64),
        (7, 3, 64, torch.bfloat16, torch.int32),
        (65, 8, 128, torch.float16, torch.int64),
        (9, 2, 80, torch.bfloat16, torch.int64),
    ],
)
def test_store_kv(T, KVH, D, dtype, slot_dtype, device):
    num_slots, pad = 4 * T + 16, 3
    H = 2 * KVH
    qkv = torch.randn((T + pad, (H + 2 * KVH) * D)).to(dtype)
    k = qkv[:, H * D : (H + KVH) * D].view(T + pad, KVH, D)
    v = qkv[:, (H + KVH) * D :].view(T + pad, KVH, D)
    slots = torch.cat([torch.randperm(num_slots - 1)[:T] + 1, torch.zeros(pad, dtype=torch.long)])
    slots = slots.to(slot_dtype)
    kc = torch.full((num_slots, KVH, D), float("nan"), dtype=dtype)
    vc = torch.full((num_slots, KVH, D), float("nan"), dtype=dtype)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    store_kv_ref(k, v, kc_ref, vc_ref, slots)
    kcd, vcd = kc.to(device), vc.to(device)
    store_kv(k.to(device), v.to(device), kcd, vcd, slots.to(device))
    # everything except the dummy slot 0 is exact (padded tokens race on slot 0)
    assert torch.equal(kcd[1:].cpu().nan_to_num(7.0), kc_ref[1:].nan_to_num(7.0))
    assert torch.equal(vcd[1:].cpu().nan_to_num(7.0), vc_ref[1:].nan_to_num(7.0))
    assert torch.equal(kcd[slots[:T].long()].cpu(), k[:T])
    assert torch.isfinite(kcd[0]).all(), "slot 0 received one of the padded tokens"


def test_asserts(device):
    k = torch.randn(4, 2, 64, device=device)
    kc = torch.zeros(16, 2, 64, device=device)
    slots = torch.arange(4, device=device)
    with pytest.raises(AssertionError, match="slot"):
        store_kv(k, k, kc, kc.clone(), slots.float())
    with pytest.raises(AssertionError, match="k_cache"):
        store_kv(k, k, kc[:, :1], kc.clone(), slots)
    with pytest.raises(AssertionError, match="is torch.float16"):
        store_kv(k, k, kc.half(), kc.clone(), slots)
