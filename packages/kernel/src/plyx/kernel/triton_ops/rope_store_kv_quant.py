"""Triton ``rope_store_kv_quant``: RoPE of q and k, k and v quantised into an int8 / fp8 cache, one launch.

``rope_store_kv``'s program (one per token and block of heads) with the quantised store of
``store_kv_quant``: k's rotated row stays in registers (float32) while its absolute maximum gives the
row's scale, then the row is quantised and stored with the scale; v's rows likewise. The contract and
the rounding are the references' (``plyx.kernel.reference.rope_store_kv_quant``). No host sync (capturable
in a CUDA graph); slots must be ``< S`` (not checked here); float8 needs Hopper (refused elsewhere).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from plyx.kernel._errors import check_last_dim_contiguous
from plyx.kernel.reference.rope_store_kv_quant import check_rope_store_kv_quant
from plyx.kernel.reference.store_kv_quant import QMAX
from plyx.kernel.triton_ops._common import empty, next_power_of_2, pdl
from plyx.kernel.triton_ops._tiles import wait_for_inputs
from plyx.kernel.triton_ops.rope import angles, rotate_rows, tables
from plyx.kernel.triton_ops.store_kv_quant import check_fp8_device, quantize, quantize_rows, row_scale

__all__ = ["rope_store_kv_quant"]

_NAME = "rope_store_kv_quant:triton"


@triton.jit
def _rope_store_kv_quant_kernel(QKV, COS, SIN, Q, KC, VC, KS, VS, SLOTS, T, H, KV, DH, HALF, sxb, sxt, sxh, sqb, sqt,
                                sqh, sks, skh, svs, svh, skss, sksh, svss, svsh, scb, sct, QMAX: tl.constexpr,
                                FP8: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr,
                                BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
                                USE_GDC: tl.constexpr):
    wait_for_inputs(USE_GDC)  # q/k/v, the tables and the slots may be the previous kernel's output
    token = tl.program_id(0).to(tl.int64)
    b = token // T
    t = token % T
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    c, s, ia, ib, rmask = angles(COS, SIN, b, t, scb, sct, HALF, INTERLEAVED, False, BLOCK_R)
    x = QKV + b * sxb + t * sxt
    rotate_rows(x + heads[:, None] * sxh, Q + b * sqb + t * sqt + heads[:, None] * sqh, heads < H,
                c, s, ia, ib, rmask, HALF, DH, BLOCK_P)
    slot = tl.load(SLOTS + token)  # int64; < 0: padding, nothing stored
    kvmask = (heads < KV) & ((tl.zeros([BLOCK_H], dtype=tl.int64) + slot) >= 0)
    # k: rotated in registers (float32), the row's maximum over the rotated pairs and the pass-through dims
    src = x + (H + heads[:, None]) * sxh
    m2 = kvmask[:, None] & rmask[None, :]
    xa = tl.load(src + ia[None, :], mask=m2, other=0.0).to(tl.float32)
    xb = tl.load(src + ib[None, :], mask=m2, other=0.0).to(tl.float32)
    ya = xa * c[None, :] - xb * s[None, :]
    yb = xb * c[None, :] + xa * s[None, :]
    amax = tl.maximum(tl.max(tl.abs(ya), 1), tl.max(tl.abs(yb), 1))  # (BLOCK_H,)
    if BLOCK_P > 0:
        p = 2 * HALF + tl.arange(0, BLOCK_P)
        pm = kvmask[:, None] & (p < DH)[None, :]
        xp = tl.load(src + p[None, :], mask=pm, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(xp), 1))
    scale = row_scale(amax, QMAX)
    dst = KC + slot * sks + heads[:, None] * skh
    tl.store(dst + ia[None, :], quantize(ya, scale, KC.dtype.element_ty, QMAX, FP8), mask=m2)
    tl.store(dst + ib[None, :], quantize(yb, scale, KC.dtype.element_ty, QMAX, FP8), mask=m2)
    if BLOCK_P > 0:
        tl.store(dst + p[None, :], quantize(xp, scale, KC.dtype.element_ty, QMAX, FP8), mask=pm)
    tl.store(KS + slot * skss + heads * sksh, scale, mask=kvmask)
    # v: quantised whole
    d = tl.arange(0, BLOCK_D)
    quantize_rows(QKV, VC, VS, b * sxb + t * sxt + (H + KV + heads) * sxh, slot * svs + heads * svh,
                  slot * svss + heads * svsh, kvmask, d, DH, QMAX, FP8)


def rope_store_kv_quant(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor, slots: torch.Tensor, *,
                        n_heads: int, n_kv_heads: int, interleaved: bool = False) -> torch.Tensor:
    """Triton ``rope_store_kv_quant``; same contract as the reference (no host sync)."""
    check_rope_store_kv_quant(_NAME, qkv, cos, sin, k_cache, v_cache, k_scale, v_scale, slots, n_heads, n_kv_heads)
    for name, tensor in (("qkv", qkv), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_dim_contiguous(_NAME, name, tensor)
    check_fp8_device(_NAME, "k_cache", k_cache)
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
        _rope_store_kv_quant_kernel[(bsz * t, triton.cdiv(heads, block_h))](
            qkv, cos, sin, q, k_cache, v_cache, k_scale, v_scale, slots, t, h, kv, dh, half, qkv.stride(0),
            qkv.stride(1), qkv.stride(2), q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1),
            v_cache.stride(0), v_cache.stride(1), k_scale.stride(0), k_scale.stride(1), v_scale.stride(0),
            v_scale.stride(1), scb, sct, QMAX=QMAX[k_cache.dtype], FP8=k_cache.dtype == torch.float8_e4m3fn,
            INTERLEAVED=bool(interleaved), BLOCK_H=block_h, BLOCK_R=next_power_of_2(half), BLOCK_P=block_p,
            BLOCK_D=next_power_of_2(dh), USE_GDC=gdc, num_warps=4, launch_pdl=gdc)
    return q
