"""Triton RoPE of q and k with k and v stored at cache slots: one launch per decode step and layer.

Replaces ``rope(q)``, ``rope(k)``, ``k_cache.index_copy_`` and ``v_cache.index_copy_``
(three or four launches) in CUDA-graph decode. One program per token ``(b, t)`` and
block of heads: the token's cos/sin are loaded once, then

- q heads ``[0, H)`` are rotated into the new ``q [B, T, H, Dh]``;
- k heads ``[H, H+KV)`` are rotated and stored at ``k_cache[slot]``, cast to its dtype;
- v heads ``[H+KV, H+2KV)`` are copied to ``v_cache[slot]``, cast to its dtype;

where ``slot = slots[b*T + t]``; a negative slot masks both stores (padding). The
rotation is ``plyx.kernel.triton_ops.rope``'s (pair ``(a, b)``, ``a*cos - b*sin``,
``b*cos + a*sin``, in float32), dims ``R..Dh`` are copied through. The wrapper reads
no tensor values on the host (no sync), so it can be captured in a CUDA graph. The
caller guarantees ``slots < S``: an out-of-range slot is not checked here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from plyx.kernel._errors import check_last_dim_contiguous
from plyx.kernel.reference.rope_store_kv import check_rope_store_kv
from plyx.kernel.triton_ops._common import empty, next_power_of_2, pdl
from plyx.kernel.triton_ops._tiles import wait_for_inputs
from plyx.kernel.triton_ops.rope import angles, rotate_rows, tables

__all__ = ["rope_store_kv"]

_NAME = "rope_store_kv:triton"


@triton.jit
def _rope_store_kv_kernel(QKV, COS, SIN, Q, KC, VC, SLOTS, T, H, KV, DH, HALF, sxb, sxt, sxh, sqb, sqt, sqh,
                          sks, skh, svs, svh, scb, sct, INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
                          USE_GDC: tl.constexpr):
    # programmatic dependent launch: every input may be the previous kernel's output (q/k/v, the tables,
    # the slots), so nothing is read before the wait
    wait_for_inputs(USE_GDC)
    token = tl.program_id(0).to(tl.int64)
    b = token // T
    t = token % T
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # q head i and kv head i share a program
    c, s, ia, ib, rmask = angles(COS, SIN, b, t, scb, sct, HALF, INTERLEAVED, False, BLOCK_R)
    x = QKV + b * sxb + t * sxt
    # q: (BLOCK_H, Dh) rows of the token, rotated into the new q
    rotate_rows(x + heads[:, None] * sxh, Q + b * sqb + t * sqt + heads[:, None] * sqh, heads < H,
                 c, s, ia, ib, rmask, HALF, DH, BLOCK_P)
    slot = tl.load(SLOTS + token)  # int64; < 0: padding, nothing stored
    # broadcast before comparing: the interpreter's scalar bool & block bool gives an int mask it then refuses
    kvmask = (heads < KV) & ((tl.zeros([BLOCK_H], dtype=tl.int64) + slot) >= 0)
    # k: rotated straight into the cache (one rounding, to the cache's dtype)
    rotate_rows(x + (H + heads[:, None]) * sxh, KC + slot * sks + heads[:, None] * skh, kvmask,
                 c, s, ia, ib, rmask, HALF, DH, BLOCK_P)
    # v: copied whole
    d = tl.arange(0, BLOCK_D)
    vm = kvmask[:, None] & (d < DH)[None, :]
    v = tl.load(x + (H + KV + heads[:, None]) * sxh + d[None, :], mask=vm, other=0.0)
    tl.store(VC + slot * svs + heads[:, None] * svh + d[None, :], v.to(VC.dtype.element_ty), mask=vm)


def rope_store_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slots: torch.Tensor, *, n_heads: int, n_kv_heads: int,
                  interleaved: bool = False) -> torch.Tensor:
    """Triton ``rope_store_kv``; same contract as ``plyx.kernel.reference.rope_store_kv`` (no host sync)."""
    check_rope_store_kv(_NAME, qkv, cos, sin, k_cache, v_cache, slots, n_heads, n_kv_heads)
    for name, t in (("qkv", qkv), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_dim_contiguous(_NAME, name, t)
    cos, sin, scb, sct = tables(cos, sin)
    slots = slots.reshape(-1)
    if slots.stride(0) != 1:
        slots = slots.contiguous()
    bsz, t, _, dh = qkv.shape
    h, kv, half = n_heads, n_kv_heads, cos.shape[-1]
    q = empty((bsz, t, h, dh), dtype=qkv.dtype, device=qkv.device)
    heads = max(h, kv)
    block_h = min(next_power_of_2(heads), 16)
    block_p = next_power_of_2(dh - 2 * half) if dh > 2 * half else 0
    gdc = pdl(qkv.device)
    if bsz * t:
        _rope_store_kv_kernel[(bsz * t, triton.cdiv(heads, block_h))](
            qkv, cos, sin, q, k_cache, v_cache, slots, t, h, kv, dh, half, qkv.stride(0), qkv.stride(1),
            qkv.stride(2), q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1),
            v_cache.stride(0), v_cache.stride(1), scb, sct, INTERLEAVED=bool(interleaved), BLOCK_H=block_h,
            BLOCK_R=next_power_of_2(half), BLOCK_P=block_p, BLOCK_D=next_power_of_2(dh), USE_GDC=gdc, num_warps=4,
            launch_pdl=gdc)
    return q
