"""Triton ``store_kv_quant``: quantise a step's keys and values and write them, with their scales, at cache slots.

One program per token and block of key/value heads. For each head's row of Dh values it takes the
row's absolute maximum (float32), the scale ``amax / QMAX``, and stores ``floor(x / scale + 0.5)``
(int8) or ``x / scale`` rounded to float8_e4m3fn, plus the scale; the definition and why scales are
per token and head: ``plyx.kernel.reference.store_kv_quant``. The division is IEEE (``div_rn``), so the
kernel rounds exactly as the reference does. No host sync (capturable in a CUDA graph); a negative slot
skips the token; slots must be ``< S`` (not checked here).

float8_e4m3fn conversions need Hopper (compute capability 9.0) or newer: elsewhere the wrapper refuses.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from plyx.kernel._errors import KernelInputError, check_last_dim_contiguous
from plyx.kernel.reference.store_kv_quant import QMAX, check_store_kv_quant
from plyx.kernel.triton_ops._common import interpreting, next_power_of_2, pdl
from plyx.kernel.triton_ops._tiles import wait_for_inputs

__all__ = ["store_kv_quant", "check_fp8_device", "quantize", "quantize_rows", "row_scale"]

_NAME = "store_kv_quant:triton"
#: float8_e4m3fn conversions in Triton: sm_90 (Hopper) and newer
FP8_MIN_CC = (9, 0)


def check_fp8_device(kernel: str, argument: str, t: torch.Tensor) -> None:
    """Refuse float8 storage on a GPU older than Hopper, naming the device and the fix."""
    if t.dtype != torch.float8_e4m3fn or t.device.type != "cuda" or interpreting():
        return
    cc = torch.cuda.get_device_capability(t.device)
    if cc < FP8_MIN_CC:
        raise KernelInputError(
            kernel, argument, f"is float8_e4m3fn, which the Triton KV kernels support on compute capability "
            f">= {FP8_MIN_CC[0]}.{FP8_MIN_CC[1]} (Hopper) only; this GPU is sm_{cc[0]}{cc[1]}",
            "use an int8 KV cache (kv_cache_dtype='int8') on this GPU")


#: Triton's interpreter (3.x) rounds float32 -> float8e4nv wrongly when the rounding carries into the exponent
#: (-31.24 -> -16 instead of -32); compiled kernels use the hardware's correct conversion
_INTERPRETER = tl.constexpr(interpreting())


@triton.jit
def _round_e4m3(y):
    """``y`` (``|y| <= 448``) rounded to the float8_e4m3fn grid in float32, nearest with ties to even (interpreter
    only: the cast that follows is then exact). The grid's step is ``2^(e - 3)`` for exponent ``e >= -6``."""
    bits = y.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6) - 3
    step = ((e + 127) << 23).to(tl.float32, bitcast=True)
    x = y / step  # exact: a power of two
    return ((x + 12582912.0) - 12582912.0) * step  # 1.5 * 2^23: float32 addition rounds x to an integer, to even


@triton.jit
def row_scale(amax, QMAX: tl.constexpr):
    """The scale of rows whose absolute maximum is ``amax`` (1 for an all-zero row)."""
    return tl.where(amax > 0, tl.math.div_rn(amax, QMAX), 1.0)


@triton.jit
def quantize(x, scale, dtype: tl.constexpr, QMAX: tl.constexpr, FP8: tl.constexpr):
    """float32 ``x`` (``[BLOCK_H, n]``) over its rows' ``scale`` (``[BLOCK_H]``), as ``dtype`` (int8 or e4m3)."""
    y = tl.math.div_rn(x, scale[:, None])
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    # one return of one type: the GPU compiler (Triton 3.6) types every return of a function, constexpr branches
    # included, so an early fp8 return next to an int8 one fails to compile (the interpreter never noticed)
    if FP8:
        if _INTERPRETER:
            y = _round_e4m3(y)
    else:
        y = tl.floor(y + 0.5)  # int8: round half up before the cast truncates
    return y.to(dtype)


@triton.jit
def quantize_rows(X, DST, SCALE, x_off, dst_off, scale_off, mask, d, DH, QMAX: tl.constexpr, FP8: tl.constexpr):
    """Quantise the ``[BLOCK_H, BLOCK_D]`` rows at ``X + x_off`` into ``DST + dst_off`` and their scales."""
    dmask = mask[:, None] & (d < DH)[None, :]
    x = tl.load(X + x_off[:, None] + d[None, :], mask=dmask, other=0.0).to(tl.float32)
    scale = row_scale(tl.max(tl.abs(x), 1), QMAX)  # (BLOCK_H,)
    tl.store(DST + dst_off[:, None] + d[None, :], quantize(x, scale, DST.dtype.element_ty, QMAX, FP8), mask=dmask)
    tl.store(SCALE + scale_off, scale, mask=mask)


@triton.jit
def _store_kv_quant_kernel(K, V, KC, VC, KS, VS, SLOTS, KV, DH, skn, skh, svn, svh, skcs, skch, svcs, svch,
                           skss, sksh, svss, svsh, QMAX: tl.constexpr, FP8: tl.constexpr, BLOCK_H: tl.constexpr,
                           BLOCK_D: tl.constexpr, USE_GDC: tl.constexpr):
    wait_for_inputs(USE_GDC)  # k and v are the previous kernel's output
    n = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    slot = tl.load(SLOTS + n)  # int64; < 0: padding, nothing stored
    # broadcast before comparing: the interpreter's scalar bool & block bool gives an int mask it then refuses
    mask = (heads < KV) & ((tl.zeros([BLOCK_H], dtype=tl.int64) + slot) >= 0)
    d = tl.arange(0, BLOCK_D)
    quantize_rows(K, KC, KS, n * skn + heads * skh, slot * skcs + heads * skch, slot * skss + heads * sksh,
                   mask, d, DH, QMAX, FP8)
    quantize_rows(V, VC, VS, n * svn + heads * svh, slot * svcs + heads * svch, slot * svss + heads * svsh,
                   mask, d, DH, QMAX, FP8)


def store_kv_quant(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   k_scale: torch.Tensor, v_scale: torch.Tensor, slots: torch.Tensor) -> None:
    """Triton ``store_kv_quant``; same contract as ``plyx.kernel.reference.store_kv_quant`` (no host sync)."""
    check_store_kv_quant(_NAME, k, v, k_cache, v_cache, k_scale, v_scale, slots)
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_dim_contiguous(_NAME, name, t)
    check_fp8_device(_NAME, "k_cache", k_cache)
    slots = slots.reshape(-1)
    if slots.stride(0) != 1:
        slots = slots.contiguous()
    n, kv, dh = k.shape
    if n == 0:
        return
    block_h = min(next_power_of_2(kv), 16)
    gdc = pdl(k.device)
    _store_kv_quant_kernel[(n, triton.cdiv(kv, block_h))](
        k, v, k_cache, v_cache, k_scale, v_scale, slots, kv, dh, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), k_scale.stride(0),
        k_scale.stride(1), v_scale.stride(0), v_scale.stride(1), QMAX=QMAX[k_cache.dtype],
        FP8=k_cache.dtype == torch.float8_e4m3fn, BLOCK_H=block_h, BLOCK_D=next_power_of_2(dh), USE_GDC=gdc,
        num_warps=4, launch_pdl=gdc)
