"""``rope_store_kv_quant``: the reference against rope + quantisation spelled out, the Triton kernel (interpreter on
CPU, compiled on a GPU) against the reference: q exactly as ``rope``, caches within one quantisation step."""

from __future__ import annotations

import pytest
import torch
from plyx.kernel import KernelInputError, rope_tables
from plyx.kernel.reference.rope import rope
from plyx.kernel.reference.rope_store_kv_quant import rope_store_kv_quant
from plyx.kernel.reference.store_kv_quant import dequantize_kv, quantize_kv

from .conftest import TRITON_DEVICE

SLOTS = 13
STORAGE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def _inputs(b, t, h, kv, dh, r, storage, dtype=torch.float32, device="cpu"):
    qkv = (torch.randn(b, t, h + 2 * kv, dh) * 3).to(device, dtype)
    cos, sin = rope_tables(torch.randint(0, 4096, (b, t), device=device), r, 10000.0, dtype=dtype)
    kc = torch.full((SLOTS, kv, dh), 1.0, device=device).to(STORAGE[storage])
    sc = torch.full((SLOTS, kv), -1.0, device=device)
    slots = torch.randperm(SLOTS, device=device)[: b * t]
    if b * t > 2:
        slots[1] = -1
    return qkv, cos, sin, kc, kc.clone(), sc, sc.clone(), slots


@pytest.mark.parametrize("storage", ["int8", "fp8"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_reference_is_rope_then_quantisation(storage, interleaved):
    h, kv, dh = 4, 2, 16
    qkv, cos, sin, kc, vc, ks, vs, slots = _inputs(2, 3, h, kv, dh, 12, storage)  # partial rotary: 12 of 16 dims
    q = rope_store_kv_quant(qkv, cos, sin, kc, vc, ks, vs, slots, n_heads=h, n_kv_heads=kv, interleaved=interleaved)
    torch.testing.assert_close(q, rope(qkv[:, :, :h], cos, sin, interleaved=interleaved), rtol=0, atol=0)
    k = rope(qkv[:, :, h:h + kv], cos, sin, interleaved=interleaved).reshape(6, kv, dh)
    v = qkv[:, :, h + kv:].reshape(6, kv, dh)
    for x, cache, sc in ((k, kc, ks), (v, vc, vs)):
        want_q, want_s = quantize_kv(x, STORAGE[storage])
        for n, slot in enumerate(slots.tolist()):
            if slot >= 0:
                assert torch.equal(cache[slot].float(), want_q[n].float()) and torch.equal(sc[slot], want_s[n])
        written = set(slots.tolist())
        assert all(float(sc[s].max()) == -1.0 for s in range(SLOTS) if s not in written)


@pytest.mark.parametrize("storage", ["int8", "fp8"])
@pytest.mark.parametrize("b,t,h,kv,dh,r", [(2, 1, 8, 2, 64, 64), (1, 3, 4, 4, 32, 16), (3, 2, 6, 3, 24, 24)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_triton_matches_the_reference(storage, b, t, h, kv, dh, r, dtype):
    from plyx.kernel.triton_ops.rope_store_kv_quant import rope_store_kv_quant as triton_op

    if storage == "fp8" and TRITON_DEVICE == "cuda" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("float8 KV kernels need Hopper")
    want = _inputs(b, t, h, kv, dh, r, storage, dtype, TRITON_DEVICE)
    got = tuple(x.clone() for x in want[3:7])
    q_ref = rope_store_kv_quant(*want, n_heads=h, n_kv_heads=kv)
    q = triton_op(*want[:3], *got, want[7], n_heads=h, n_kv_heads=kv)
    torch.testing.assert_close(q.float(), q_ref.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)
    for i in (0, 1):  # keys, values
        cache, scale, ref_cache, ref_scale = got[i], got[2 + i], want[3 + i], want[5 + i]
        torch.testing.assert_close(scale, ref_scale, rtol=1e-5, atol=0)  # k rotated with or without FMA
        step = ref_scale.abs()[..., None] * (1.0 if storage == "int8" else 2.0 ** -3 * 448)
        diff = (dequantize_kv(cache, scale) - dequantize_kv(ref_cache, ref_scale)).abs()
        assert bool((diff <= step * 1.0001 + 1e-6).all())  # at most one step apart (a rounding tie)


def test_bad_cache_names_the_fix():
    qkv, cos, sin, kc, vc, ks, vs, slots = _inputs(1, 2, 2, 1, 8, 8, "int8")
    with pytest.raises(KernelInputError, match="k_cache.*int8 or float8"):
        rope_store_kv_quant(qkv, cos, sin, kc.float(), vc.float(), ks, vs, slots, n_heads=2, n_kv_heads=1)
    with pytest.raises(KernelInputError, match="qkv"):
        rope_store_kv_quant(qkv[:, :, :3], cos, sin, kc, vc, ks, vs, slots, n_heads=2, n_kv_heads=1)
