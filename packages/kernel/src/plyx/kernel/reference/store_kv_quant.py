"""KV-cache quantisation (reference): ``quantize_kv``, ``dequantize_kv`` and the ``store_kv_quant`` kernel.

Keys and values are stored as int8 or float8_e4m3fn with one float32 scale per token and key/value head
(a row of ``Dh`` values), symmetric (no zero point)::

    amax  = max_d |x[n, h, d]|                     (float32)
    scale = amax / QMAX   (QMAX: 127 for int8, 448 for fp8_e4m3; 1 where amax == 0)
    q     = floor(x / scale + 0.5) clamped to [-127, 127]        int8
          = (x / scale) clamped to [-448, 448], rounded to nearest even   fp8_e4m3
    x'    = q * scale                            (what a read gives back)

Why per token and head: the cache is written a token at a time (decode), and a token's scale then
depends on its own values alone, so nothing already stored is ever re-quantised (a per-block scale
would have to be fixed before the block's later tokens are known, or rescale the block on every
append); outlier tokens (attention sinks, the first token) do not coarsen their neighbours. The cost is
4 bytes per row of Dh values: 3% of an int8 row at Dh = 128.

``store_kv_quant(k, v, k_cache, v_cache, k_scale, v_scale, slots)`` quantises ``k``, ``v`` ``[N, KV, Dh]``
and writes row n to ``k_cache[slots[n]]`` / ``k_scale[slots[n]]`` (a negative slot skips the token; the
caches are flat slot views ``[S, KV, Dh]`` of the pools, the scales ``[S, KV]`` float32). Inference only.
"""

from __future__ import annotations

import torch
from plyx.kernel._errors import KernelInputError, check_float, check_same_device, shape_str

__all__ = ["KV_QUANT_DTYPES", "QMAX", "bytes_view", "dequantize_kv", "quantize_kv", "store_kv_quant", "check_store_kv_quant"]

#: the storage dtypes of a quantised KV cache, by their plyx names
KV_QUANT_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
#: the largest magnitude a stored value takes (int8 is kept symmetric: -128 is never used)
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def _storage(kernel: str, name: str, dtype: torch.dtype) -> float:
    try:
        return QMAX[dtype]
    except KeyError:
        raise KernelInputError(kernel, name, f"has dtype {dtype}, expected int8 or float8_e4m3fn",
                               "allocate the quantised pools with one of plyx.kernel.reference.KV_QUANT_DTYPES") from None


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., Dh]`` -> ``(q [..., Dh] of dtype, scale [...] float32)``, one scale per row of ``Dh``.

    Args:
        x: keys or values, any float dtype.
        dtype: ``torch.int8`` or ``torch.float8_e4m3fn``.

    Returns:
        The quantised rows and their scales (``x ~= q * scale[..., None]``).
    """
    qmax = _storage("quantize_kv", "dtype", dtype)
    xf = x.detach().to(torch.float32)
    amax = xf.abs().amax(dim=-1)  # (...,)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    y = xf / scale[..., None]
    if dtype == torch.int8:
        q = torch.floor(y + 0.5).clamp_(-qmax, qmax).to(torch.int8)  # half up, as the Triton kernel rounds
    else:
        q = y.clamp_(-qmax, qmax).to(dtype)  # e4m3fn has no inf: clamp first, or an overshoot becomes NaN
    return q, scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q [..., Dh]`` and ``scale [...]`` -> ``q * scale`` in ``dtype`` (computed in float32, or float64)."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    return (q.to(compute) * scale.to(compute)[..., None]).to(dtype)


def bytes_view(t: torch.Tensor) -> torch.Tensor:
    """The same memory as bytes: index_copy_/index_select have no CPU kernels for float8 (moves are bitwise)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def check_store_kv_quant(kernel: str, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         k_scale: torch.Tensor, v_scale: torch.Tensor, slots: torch.Tensor) -> None:
    """Validate shapes, dtypes and devices (reads no values)."""
    check_float(kernel, "k", k)
    check_float(kernel, "v", v)
    if k.dim() != 3 or v.shape != k.shape:
        raise KernelInputError(kernel, "k", f"k {shape_str(k.shape)} and v {shape_str(v.shape)} must both be [N, KV, Dh]",
                               "pass the new keys and values flattened over tokens")
    n, kv, dh = k.shape
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        _storage(kernel, name, cache.dtype)
        if cache.dim() != 3 or tuple(cache.shape[1:]) != (kv, dh):
            raise KernelInputError(kernel, name, f"expected [S, KV={kv}, Dh={dh}], got {shape_str(cache.shape)}",
                                   "pass a flat slot view of the pool, e.g. `pool.view(-1, n_kv_heads, head_dim)`")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise KernelInputError(kernel, "v_cache", f"{shape_str(v_cache.shape)} {v_cache.dtype} differs from k_cache's "
                               f"{shape_str(k_cache.shape)} {k_cache.dtype}", "pass the k and v views of one cache")
    for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
        if sc.dtype != torch.float32 or tuple(sc.shape) != (k_cache.shape[0], kv):
            raise KernelInputError(kernel, name, f"expected float32 [S={k_cache.shape[0]}, KV={kv}], got "
                                   f"{sc.dtype} {shape_str(sc.shape)}", "pass the scale pool's flat view `scale.view(-1, KV)`")
    if not isinstance(slots, torch.Tensor) or slots.dtype != torch.int64 or slots.numel() != n:
        got = f"{slots.dtype} with {slots.numel()} elements" if isinstance(slots, torch.Tensor) else type(slots).__name__
        raise KernelInputError(kernel, "slots", f"expected {n} int64 slots, got {got}",
                               "pass one slot per token (`.to(torch.int64)`; negative: do not store)")
    check_same_device(kernel, ("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache), ("k_scale", k_scale),
                      ("v_scale", v_scale), ("slots", slots))


def store_kv_quant(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   k_scale: torch.Tensor, v_scale: torch.Tensor, slots: torch.Tensor) -> None:
    """Quantise ``k``, ``v`` ``[N, KV, Dh]`` and store them (and their scales) at ``slots``; see the module doc."""
    kernel = "store_kv_quant:reference"
    check_store_kv_quant(kernel, k, v, k_cache, v_cache, k_scale, v_scale, slots)
    flat = slots.reshape(-1)
    keep = flat >= 0  # (N,) padding tokens are not stored
    where = flat[keep]
    if where.numel() and int(where.max()) >= k_cache.shape[0]:  # host sync: fine in the reference, never in Triton
        raise KernelInputError(kernel, "slots", f"slot {int(where.max())} is out of range for a cache of "
                               f"{k_cache.shape[0]} slots", "slots index dim 0 of k_cache / v_cache")
    with torch.no_grad():  # the caches are buffers, never part of a graph
        for x, cache, sc in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
            q, s = quantize_kv(x[keep], cache.dtype)
            bytes_view(cache).index_copy_(0, where, bytes_view(q))
            sc.index_copy_(0, where, s)
