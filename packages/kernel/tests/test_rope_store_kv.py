"""``rope_store_kv``: the reference and the Triton kernel against a float64 oracle built from ``rope`` + indexing."""

from __future__ import annotations

import plyx.kernel as K
import pytest
import torch
from plyx.kernel import KernelInputError, reference, registry, rope_tables
from plyx.kernel.reference.rope import rope

from .conftest import TOLERANCES, TRITON_DEVICE, rel_max_err

SENTINEL = -3.0  # every cache row starts at this; a row no token writes must still hold it exactly
SLOTS = 13  # cache rows, more than B*T in every case


def _oracle(qkv, cos, sin, k_cache, v_cache, slots, h, kv, interleaved):
    """float64 q, k_cache and v_cache, token by token: ``rope`` of q and k, then explicit row writes."""
    x, c, s = qkv.detach().double().cpu(), cos.double().cpu(), sin.double().cpu()
    q = rope(x[:, :, :h], c, s, interleaved=interleaved)
    k = rope(x[:, :, h:h + kv], c, s, interleaved=interleaved)
    v = x[:, :, h + kv:]
    kc, vc = k_cache.double().cpu().clone(), v_cache.double().cpu().clone()
    b, t = x.shape[:2]
    for bi in range(b):
        for ti in range(t):
            slot = int(slots[bi * t + ti])
            if slot >= 0:
                kc[slot], vc[slot] = k[bi, ti], v[bi, ti]
    return q, kc, vc


def _inputs(b, t, h, kv, dh, r, *, dtype, cache_dtype=None, batched=False, padded=True, device=TRITON_DEVICE):
    """Random qkv, tables at random positions, sentinel caches and distinct random slots (some -1)."""
    qkv = torch.randn(b, t, h + 2 * kv, dh).to(device, dtype)
    positions = torch.randint(0, 4096, (b, t) if batched else (t,), device=device)
    cos, sin = rope_tables(positions, r, 10000.0, dtype=dtype)
    cache_dtype = cache_dtype or dtype
    k_cache = torch.full((SLOTS, kv, dh), SENTINEL, dtype=cache_dtype, device=device)
    v_cache = torch.full((SLOTS, kv, dh), SENTINEL, dtype=cache_dtype, device=device)
    slots = torch.randperm(SLOTS)[: b * t]
    if padded and b * t > 1:
        slots[torch.randperm(b * t)[: max(1, b * t // 3)]] = -1
    return qkv, cos, sin, k_cache, v_cache, slots.to(device)


def _check(fn, qkv, cos, sin, k_cache, v_cache, slots, h, kv, interleaved, tol, where):
    before = qkv.clone()
    want_q, want_k, want_v = _oracle(qkv, cos, sin, k_cache, v_cache, slots, h, kv, interleaved)
    q = fn(qkv, cos, sin, k_cache, v_cache, slots, n_heads=h, n_kv_heads=kv, interleaved=interleaved)
    assert q.shape == want_q.shape and q.dtype == qkv.dtype and q.is_contiguous(), where
    assert torch.equal(qkv, before), f"{where}: qkv was modified"
    written = slots.cpu()[slots.cpu() >= 0]
    unwritten = torch.ones(SLOTS, dtype=torch.bool)
    unwritten[written] = False
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        assert (cache.cpu()[unwritten] == SENTINEL).all(), f"{where}: {name} rows without a token changed"
    assert (err := rel_max_err(q, want_q)) <= tol, f"{where}: q error {err:.2e} > {tol:.0e}"
    if written.numel():
        assert (err := rel_max_err(k_cache[written.to(k_cache.device)], want_k[written])) <= tol, \
            f"{where}: k_cache error {err:.2e} > {tol:.0e}"
        got_v = v_cache[written.to(v_cache.device)].cpu()
        if v_cache.dtype == qkv.dtype or v_cache.dtype.itemsize > qkv.dtype.itemsize:
            # v is a copy, widened or kept: exactly the value
            assert torch.equal(got_v, want_v[written].to(v_cache.dtype)), f"{where}: v_cache rows differ"
        else:  # narrowed: one rounding (Triton's interpreter truncates to bf16, the GPU rounds to nearest)
            assert (err := rel_max_err(got_v, want_v[written])) <= tol, f"{where}: v_cache error {err:.2e} > {tol:.0e}"


# (B, T, H, KV, Dh, R, interleaved, batched tables)
REFERENCE_CASES = [
    (1, 1, 4, 4, 8, 8, False, False),  # MHA decode
    (3, 1, 4, 2, 8, 8, True, True),  # GQA decode, interleaved, per-batch positions
    (2, 3, 6, 1, 10, 6, False, True),  # MQA prefill chunk, partial rotary
    (2, 4, 4, 2, 12, 4, True, False),  # partial + interleaved
]


@pytest.mark.parametrize("case", REFERENCE_CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_reference_matches_the_oracle(case, dtype, fresh_seed):
    b, t, h, kv, dh, r, interleaved, batched = case
    args = _inputs(b, t, h, kv, dh, r, dtype=dtype, batched=batched, device="cpu")
    tol = 1e-12 if dtype == torch.float64 else TOLERANCES[torch.float32][0]
    _check(reference.rope_store_kv, *args, h, kv, interleaved, tol, f"reference {case} {dtype} seed={fresh_seed}")


# (B, T, H, KV, Dh, R, interleaved, batched tables, cache dtype: None = qkv's)
TRITON_CASES = [
    (2, 1, 4, 2, 16, 16, False, False, None),  # GQA decode
    (3, 2, 6, 1, 12, 8, True, True, None),  # MQA, partial + interleaved, per-batch positions
    (2, 1, 17, 1, 8, 8, False, True, torch.float32),  # H=17 straddles the 16-head block; bf16 -> fp32 cache
    (1, 3, 2, 2, 8, 4, False, False, torch.bfloat16),  # partial rotary; fp32 -> bf16 cache
]


@pytest.mark.parametrize("case", TRITON_CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_matches_the_oracle(case, dtype, fresh_seed):
    from plyx.kernel.triton_ops._common import poisoned
    from plyx.kernel.triton_ops.rope_store_kv import rope_store_kv

    b, t, h, kv, dh, r, interleaved, batched, cache_dtype = case
    args = _inputs(b, t, h, kv, dh, r, dtype=dtype, cache_dtype=cache_dtype, batched=batched)
    # the looser tolerance where either side rounds to bfloat16
    tol = TOLERANCES[torch.bfloat16 if torch.bfloat16 in (dtype, args[3].dtype) else torch.float32][0]
    with poisoned():  # an unwritten q element is NaN
        _check(rope_store_kv, *args, h, kv, interleaved, tol, f"triton {case} {dtype} seed={fresh_seed}")


def test_triton_reads_strided_views_of_the_projection(fresh_seed):
    """qkv as a view of a linear output [B, T, (H+2KV)*Dh] with padding columns, and of a bigger head buffer."""
    from plyx.kernel.triton_ops.rope_store_kv import rope_store_kv

    b, t, h, kv, dh = 2, 2, 4, 2, 8
    linear = torch.randn(b, t, (h + 2 * kv) * dh + 5, device=TRITON_DEVICE)  # token stride 69, not (H+2KV)*Dh
    big = torch.randn(b, t + 1, h + 2 * kv + 3, dh, device=TRITON_DEVICE)
    views = {"linear": linear[..., : (h + 2 * kv) * dh].unflatten(-1, (h + 2 * kv, dh)),
             "big": big[:, 1:, : h + 2 * kv]}
    for label, qkv in views.items():
        assert not qkv.is_contiguous()
        _, cos, sin, k_cache, v_cache, slots = _inputs(b, t, h, kv, dh, dh, dtype=torch.float32)
        _check(rope_store_kv, qkv, cos, sin, k_cache, v_cache, slots, h, kv, False, TOLERANCES[torch.float32][0],
               f"triton {label} view seed={fresh_seed}")


def test_all_tokens_padded_stores_nothing():
    from plyx.kernel.triton_ops.rope_store_kv import rope_store_kv

    qkv, cos, sin, k_cache, v_cache, _ = _inputs(2, 1, 2, 1, 8, 8, dtype=torch.float32)
    slots = torch.full((2,), -1, dtype=torch.int64, device=TRITON_DEVICE)
    for fn in (rope_store_kv, reference.rope_store_kv):
        q = fn(qkv.to(TRITON_DEVICE), cos, sin, k_cache, v_cache, slots, n_heads=2, n_kv_heads=1)
        assert torch.allclose(q.cpu(), rope(qkv[:, :, :2], cos, sin).cpu(), atol=1e-5)
        assert (k_cache == SENTINEL).all() and (v_cache == SENTINEL).all()


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_bad_inputs_name_the_argument(impl):
    if impl == "triton":
        from plyx.kernel.triton_ops.rope_store_kv import rope_store_kv as fn
    else:
        fn = reference.rope_store_kv
    qkv, cos, sin, k_cache, v_cache, slots = _inputs(2, 3, 4, 2, 8, 8, dtype=torch.float32)
    kw = {"n_heads": 4, "n_kv_heads": 2}
    with pytest.raises(KernelInputError, match=rf"rope_store_kv:{impl}.*`qkv`.*H \+ 2\*KV = 6"):
        fn(qkv, cos, sin, k_cache, v_cache, slots, n_heads=4, n_kv_heads=1)
    with pytest.raises(KernelInputError, match=r"`slots`.*5 elements.*B\*T = 2\*3 = 6"):
        fn(qkv, cos, sin, k_cache, v_cache, slots[:5], **kw)
    with pytest.raises(KernelInputError, match=r"`slots`.*int64.*float32"):
        fn(qkv, cos, sin, k_cache, v_cache, slots.float(), **kw)
    with pytest.raises(KernelInputError, match=r"`v_cache`.*KV=2, Dh=8.*\[13, 1, 8\]"):
        fn(qkv, cos, sin, k_cache, v_cache[:, :1], slots, **kw)
    with pytest.raises(KernelInputError, match=r"`cos`.*T=3"):
        fn(qkv, cos[:2], sin[:2], k_cache, v_cache, slots, **kw)
    with pytest.raises(KernelInputError, match=r"`qkv`.*no gradient.*`rope` \+ the cache's append"):
        fn(qkv.requires_grad_(), cos, sin, k_cache, v_cache, slots, **kw)
    with torch.no_grad():  # outside grad mode a qkv that requires grad is fine
        fn(qkv, cos, sin, k_cache, v_cache, slots, **kw)


def test_reference_refuses_out_of_range_slots():
    qkv, cos, sin, k_cache, v_cache, slots = _inputs(1, 2, 2, 1, 8, 8, dtype=torch.float32, padded=False, device="cpu")
    slots[1] = SLOTS
    with pytest.raises(KernelInputError, match=rf"`slots`.*{SLOTS} is out of range"):
        reference.rope_store_kv(qkv, cos, sin, k_cache, v_cache, slots, n_heads=2, n_kv_heads=1)


def test_registry_resolves_the_reference_on_cpu_and_dispatch_stores():
    qkv, cos, sin, k_cache, v_cache, slots = _inputs(2, 1, 4, 2, 8, 8, dtype=torch.float32, padded=False, device="cpu")
    assert registry().get("rope_store_kv", qkv, cos, sin) is reference.rope_store_kv
    impls = {i.impl: i for i in registry().implementations("rope_store_kv")}
    assert set(impls) >= {"reference", "triton"}
    assert not impls["triton"].capability.backward  # with grad the registry picks the reference, which explains
    assert impls["triton"].capability.shape_limits == {"head_dim": (2, 1024)}
    want_q, want_k, _ = _oracle(qkv, cos, sin, k_cache, v_cache, slots, 4, 2, False)
    q = K.rope_store_kv(qkv, cos, sin, k_cache, v_cache, slots, n_heads=4, n_kv_heads=2)
    assert rel_max_err(q, want_q) <= 1e-5 and rel_max_err(k_cache, want_k) <= 1e-5
