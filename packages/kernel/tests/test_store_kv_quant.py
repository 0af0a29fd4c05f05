"""``store_kv_quant`` and the int8 / fp8_e4m3 quantisation it defines: the reference against a float64 oracle
of the formula, and the Triton kernel (interpreter on CPU, compiled on a GPU) against the reference."""

from __future__ import annotations

import pytest
import torch
from plyx.kernel import KernelInputError, registry
from plyx.kernel.reference.store_kv_quant import QMAX, dequantize_kv, quantize_kv, store_kv_quant

from .conftest import TRITON_DEVICE

DTYPES = [torch.int8, torch.float8_e4m3fn]
IDS = ["int8", "fp8"]
SLOTS = 23


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _caches(kv, dh, dtype, device):
    """Caches and scales filled with a sentinel: a slot no token writes must keep it."""
    kc = torch.full((SLOTS, kv, dh), 3, dtype=torch.float32, device=device).to(dtype)
    sc = torch.full((SLOTS, kv), -1.0, device=device)
    return kc, kc.clone(), sc, sc.clone()


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["f32", "bf16", "f64"])
def test_quantize_matches_the_float64_formula(dtype, in_dtype):
    x = (torch.randn(7, 3, 24, dtype=torch.float64) * torch.logspace(-3, 2, 7, dtype=torch.float64)[:, None, None])
    x = x.to(in_dtype)
    x[2, 1] = 0  # an all-zero row: scale 1, values 0
    q, scale = quantize_kv(x, dtype)
    xd = x.double()
    amax = xd.abs().amax(-1)
    want_scale = torch.where(amax > 0, amax / QMAX[dtype], torch.ones_like(amax))
    assert scale.dtype == torch.float32 and q.dtype == dtype
    torch.testing.assert_close(scale.double(), want_scale, rtol=2e-7, atol=0)  # one float32 rounding
    back = dequantize_kv(q, scale, torch.float64)
    err = (back - xd).abs()
    if dtype == torch.int8:
        # rounding to the nearest integer step: at most half a step (plus float32 slack)
        assert bool((err <= 0.5 * want_scale[..., None] * (1 + 1e-5)).all())
        assert int(q.to(torch.int16).abs().max()) == 127  # the row maximum maps to the end of the range
    else:
        # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 relative (subnormals: half of 2^-9 * scale)
        bound = torch.maximum(xd.abs() * 2.0**-4, 2.0**-10 * want_scale[..., None])
        assert bool((err <= bound * (1 + 1e-5)).all())
    assert bool((back[2, 1] == 0).all()) and float(scale[2, 1]) == 1.0


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_reference_store_writes_only_its_slots(dtype):
    kv, dh = 2, 8
    k, v = torch.randn(6, kv, dh), torch.randn(6, kv, dh)
    slots = torch.tensor([4, -1, 0, 17, 9, 22])
    kc, vc, ks, vs = _caches(kv, dh, dtype, "cpu")
    store_kv_quant(k, v, kc, vc, ks, vs, slots)
    for x, cache, sc in ((k, kc, ks), (v, vc, vs)):
        qx, sx = quantize_kv(x, dtype)
        for n, slot in enumerate(slots.tolist()):
            if slot >= 0:
                assert torch.equal(_raw(cache[slot]), _raw(qx[n])) and torch.equal(sc[slot], sx[n])
        untouched = [s for s in range(SLOTS) if s not in set(slots.tolist())]
        assert bool((cache[untouched].float() == 3).all()) and bool((sc[untouched] == -1).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("n,kv,dh", [(5, 2, 64), (3, 1, 128), (9, 3, 24), (1, 8, 16)])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_triton_matches_the_reference(dtype, n, kv, dh, in_dtype):
    dev = TRITON_DEVICE
    scale_rows = torch.logspace(-2, 2, n)[:, None, None]
    k = (torch.randn(n, kv, dh) * scale_rows).to(dev, in_dtype)
    v = (torch.randn(n, kv, dh) * scale_rows).to(dev, in_dtype)
    slots = torch.randperm(SLOTS)[:n].to(dev)
    if n > 2:
        slots[1] = -1  # padding: stored nowhere
    want = _caches(kv, dh, dtype, dev)
    got = _caches(kv, dh, dtype, dev)
    store_kv_quant(k, v, *want, slots)
    from plyx.kernel.triton_ops.store_kv_quant import store_kv_quant as triton_store

    triton_store(k, v, *got, slots)
    torch.testing.assert_close(got[2], want[2], rtol=2e-7, atol=0)  # scales: one rounding each, IEEE division
    torch.testing.assert_close(got[3], want[3], rtol=2e-7, atol=0)
    for g, w in ((got[0], want[0]), (got[1], want[1])):
        if TRITON_DEVICE == "cpu":  # the interpreter computes in numpy float32: the same roundings
            assert torch.equal(_raw(g), _raw(w))
        else:  # a compiled division may differ in the last bit: at most one step apart, rarely
            diff = (g.float() - w.float()).abs()
            step = 1.0 if dtype == torch.int8 else w.float().abs() * 2.0**-3 + 2.0**-9
            assert bool((diff <= step).all()) and float((diff > 0).float().mean()) < 0.01


def test_errors_name_the_argument_and_the_fix():
    k = torch.randn(2, 2, 8)
    kc, vc, ks, vs = _caches(2, 8, torch.int8, "cpu")
    with pytest.raises(KernelInputError, match="k_cache.*int8 or float8_e4m3fn"):
        store_kv_quant(k, k, kc.float(), vc.float(), ks, vs, torch.tensor([0, 1]))
    with pytest.raises(KernelInputError, match="k_scale.*float32"):
        store_kv_quant(k, k, kc, vc, ks.half(), vs, torch.tensor([0, 1]))
    with pytest.raises(KernelInputError, match="slots.*int64"):
        store_kv_quant(k, k, kc, vc, ks, vs, torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(KernelInputError, match="out of range"):
        store_kv_quant(k, k, kc, vc, ks, vs, torch.tensor([0, SLOTS]))
    with pytest.raises(KernelInputError, match="int8 or float8"):
        quantize_kv(k, torch.float16)


def test_registered_under_its_name():
    impls = {c.impl.impl for c in registry().explain("store_kv_quant", _query())}
    assert {"reference", "triton"} <= impls


def _query():
    from plyx.kernel._registry import query_for

    return query_for("store_kv_quant", torch.randn(2, 2, 8))
