"""``rope_store_kv(qkv, cos, sin, k_cache, v_cache, slots, *, n_heads, n_kv_heads, interleaved=False)`` (reference).

The decode-step fusion of "RoPE on q and k" + "store k at the cache slots" +
"store v at the cache slots" (three launches per layer unfused)::

    q, k, v = qkv[:, :, :H], qkv[:, :, H:H+KV], qkv[:, :, H+KV:]     # (B, T, heads, Dh)
    k_cache[slots[b*T + t]] = rope(k)[b, t]    for every token with slots[b*T + t] >= 0
    v_cache[slots[b*T + t]] = v[b, t]
    return rope(q)                              # new, contiguous [B, T, H, Dh], qkv's dtype

``rope`` is ``plyx.kernel.reference.rope`` (rotate-half or interleaved, partial
rotary, ``[T, R/2]`` or ``[B, T, R/2]`` tables). A negative slot skips the token
(padding); duplicate slots must carry identical values. k is rotated in float32
(or float64) and rounded once, to the cache's dtype. Inference only: there is no
gradient (training uses ``rope`` and the cache's append).
"""

from __future__ import annotations

import torch
from plyx.kernel._errors import KernelInputError, check_float, check_no_grad, check_same_device, shape_str
from plyx.kernel.reference.rope import check_rope, rope

__all__ = ["rope_store_kv", "check_rope_store_kv"]


def _check_heads(kernel: str, n_heads: int, n_kv_heads: int) -> None:
    for name, value in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise KernelInputError(kernel, name, f"expected a positive int, got {value!r}",
                                   "pass the model's head counts as Python ints")


def _check_cache(kernel: str, name: str, cache: torch.Tensor, kv: int, dh: int) -> None:
    check_float(kernel, name, cache)
    if cache.dim() != 3 or tuple(cache.shape[1:]) != (kv, dh):
        raise KernelInputError(kernel, name, f"expected [S, KV={kv}, Dh={dh}], got {shape_str(cache.shape)}",
                               "pass a flat slot view of the pool, e.g. `pool.view(-1, n_kv_heads, head_dim)`")


def check_rope_store_kv(kernel: str, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slots: torch.Tensor, n_heads: int, n_kv_heads: int) -> int:
    """Validate (without reading any tensor's values) and return R, the number of rotated dims."""
    _check_heads(kernel, n_heads, n_kv_heads)
    check_float(kernel, "qkv", qkv)
    if qkv.dim() != 4 or qkv.shape[2] != n_heads + 2 * n_kv_heads:
        raise KernelInputError(
            kernel, "qkv",
            f"expected [B, T, H + 2*KV = {n_heads + 2 * n_kv_heads}, Dh] (n_heads={n_heads}, n_kv_heads={n_kv_heads}), "
            f"got {shape_str(qkv.shape)}",
            "view the packed projection as (B, T, n_heads + 2 * n_kv_heads, head_dim), q heads then k then v")
    check_no_grad(kernel, {"qkv": qkv}, "call it under torch.inference_mode() / torch.no_grad(), or use `rope` + "
                  "the cache's append for training")
    rotary = check_rope(kernel, qkv, cos, sin)
    b, t, _, dh = qkv.shape
    _check_cache(kernel, "k_cache", k_cache, n_kv_heads, dh)
    _check_cache(kernel, "v_cache", v_cache, n_kv_heads, dh)
    if v_cache.shape != k_cache.shape:
        raise KernelInputError(kernel, "v_cache", f"shape {shape_str(v_cache.shape)} differs from k_cache's "
                               f"{shape_str(k_cache.shape)}", "pass the k and v views of the same pool")
    if not isinstance(slots, torch.Tensor) or slots.dtype != torch.int64:
        got = slots.dtype if isinstance(slots, torch.Tensor) else type(slots).__name__
        raise KernelInputError(kernel, "slots", f"expected an int64 tensor, got {got}",
                               "cast it with `.to(torch.int64)` (negative slots mean: do not store)")
    if slots.numel() != b * t:
        raise KernelInputError(kernel, "slots", f"has {slots.numel()} elements, expected B*T = {b}*{t} = {b * t}",
                               "pass one slot per token, row-major over (b, t); -1 for padding")
    check_same_device(kernel, ("qkv", qkv), ("k_cache", k_cache), ("v_cache", v_cache), ("slots", slots))
    return rotary


def rope_store_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slots: torch.Tensor, *, n_heads: int, n_kv_heads: int,
                  interleaved: bool = False) -> torch.Tensor:
    kernel = "rope_store_kv:reference"
    check_rope_store_kv(kernel, qkv, cos, sin, k_cache, v_cache, slots, n_heads, n_kv_heads)
    b, t, _, dh = qkv.shape
    h, kv = n_heads, n_kv_heads
    flat = slots.reshape(-1)
    keep = flat >= 0  # (B*T,) padding tokens are not stored
    where = flat[keep]
    if where.numel() and int(where.max()) >= k_cache.shape[0]:  # host sync: fine in the reference, never in Triton
        raise KernelInputError(kernel, "slots", f"slot {int(where.max())} is out of range for a cache of "
                               f"{k_cache.shape[0]} slots", "slots index dim 0 of k_cache / v_cache")
    compute = torch.promote_types(qkv.dtype, torch.float32)
    q = rope(qkv[:, :, :h], cos, sin, interleaved=interleaved)  # (B, T, H, Dh), a new tensor
    k = rope(qkv[:, :, h:h + kv].to(compute), cos, sin, interleaved=interleaved)  # rounded once, to the cache dtype
    v = qkv[:, :, h + kv:]
    with torch.no_grad():  # the caches are buffers, never part of a graph
        k_cache.index_copy_(0, where, k.reshape(b * t, kv, dh)[keep].to(k_cache.dtype))
        v_cache.index_copy_(0, where, v.reshape(b * t, kv, dh)[keep].to(v_cache.dtype))
    return q.contiguous()
