"""``rope_store_kv_quant(qkv, cos, sin, k_cache, v_cache, k_scale, v_scale, slots, *, n_heads, n_kv_heads,
interleaved=False)`` (reference): ``rope_store_kv`` into a quantised cache.

The decode-step fusion of "RoPE on q and k" + "quantise and store k and v at the cache slots"::

    q, k, v = qkv[:, :, :H], qkv[:, :, H:H+KV], qkv[:, :, H+KV:]
    store_kv_quant(rope(k) in float32, v, k_cache, v_cache, k_scale, v_scale, slots)   # per token and head scales
    return rope(q)                                                # new, contiguous [B, T, H, Dh], qkv's dtype

k is rotated in float32 (float64 for float64 input) and quantised from there: no rounding to qkv's dtype in
between. Caches: int8 or float8_e4m3fn flat slot views ``[S, KV, Dh]``; scales float32 ``[S, KV]``; a
negative slot skips the token. Inference only.
"""

from __future__ import annotations

import torch
from plyx.kernel._errors import KernelInputError, check_float, check_no_grad, shape_str
from plyx.kernel.reference.rope import check_rope, rope
from plyx.kernel.reference.store_kv_quant import check_store_kv_quant, store_kv_quant

__all__ = ["check_rope_store_kv_quant", "rope_store_kv_quant"]


def check_rope_store_kv_quant(kernel: str, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                              k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor,
                              v_scale: torch.Tensor, slots: torch.Tensor, n_heads: int, n_kv_heads: int) -> int:
    """Validate (reading no tensor's values) and return R, the number of rotated dims."""
    for name, value in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise KernelInputError(kernel, name, f"expected a positive int, got {value!r}",
                                   "pass the model's head counts as Python ints")
    check_float(kernel, "qkv", qkv)
    if qkv.dim() != 4 or qkv.shape[2] != n_heads + 2 * n_kv_heads:
        raise KernelInputError(
            kernel, "qkv", f"expected [B, T, H + 2*KV = {n_heads + 2 * n_kv_heads}, Dh], got {shape_str(qkv.shape)}",
            "view the packed projection as (B, T, n_heads + 2 * n_kv_heads, head_dim), q heads then k then v")
    check_no_grad(kernel, {"qkv": qkv}, "call it under torch.inference_mode() / torch.no_grad()")
    rotary = check_rope(kernel, qkv, cos, sin)
    b, t, _, dh = qkv.shape
    kv = qkv[:, :, :n_kv_heads].reshape(b * t, n_kv_heads, dh) if b * t else qkv.new_empty((0, n_kv_heads, dh))
    check_store_kv_quant(kernel, kv, kv, k_cache, v_cache, k_scale, v_scale, slots)
    return rotary


def rope_store_kv_quant(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor, slots: torch.Tensor, *,
                        n_heads: int, n_kv_heads: int, interleaved: bool = False) -> torch.Tensor:
    check_rope_store_kv_quant("rope_store_kv_quant:reference", qkv, cos, sin, k_cache, v_cache, k_scale, v_scale,
                              slots, n_heads, n_kv_heads)
    b, t, _, dh = qkv.shape
    h, kv = n_heads, n_kv_heads
    compute = torch.promote_types(qkv.dtype, torch.float32)
    q = rope(qkv[:, :, :h], cos, sin, interleaved=interleaved)  # (B, T, H, Dh), a new tensor
    k = rope(qkv[:, :, h:h + kv].to(compute), cos, sin, interleaved=interleaved)  # quantised from float32
    v = qkv[:, :, h + kv:]
    store_kv_quant(k.reshape(b * t, kv, dh), v.reshape(b * t, kv, dh), k_cache, v_cache, k_scale, v_scale,
                   slots.reshape(-1))
    return q.contiguous()
