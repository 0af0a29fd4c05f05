"""Argument checks shared by every attention implementation.

Every implementation calls these first so that a wrong argument fails the same
way, with the argument's name, the value, the expected form and the fix,
whichever backend the registry picked.
"""

from __future__ import annotations

import torch

__all__ = ["AttentionArgs", "check_attention", "check_paged", "check_paged_quant"]


class AttentionArgs:
    """The sizes of one ``attention`` call: q [B, T, H, Dh], k/v [B, S, KV, Dh]."""

    __slots__ = ("B", "T", "S", "H", "KV", "D", "scale")

    def __init__(self, B: int, T: int, S: int, H: int, KV: int, D: int, scale: float) -> None:
        self.B, self.T, self.S, self.H, self.KV, self.D, self.scale = B, T, S, H, KV, D, scale


def _shape_error(name: str, tensor: torch.Tensor, expected: str, fix: str) -> ValueError:
    return ValueError(f"attention: `{name}` has shape {tuple(tensor.shape)}, expected {expected}; {fix}")


def check_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None,
    mask: torch.Tensor | None,
    document_ids: torch.Tensor | None,
    window: int | None,
) -> AttentionArgs:
    """Validate the ``attention`` contract and return its sizes."""
    if q.dim() != 4:
        raise _shape_error("q", q, "[B, T, H, Dh]", "pass queries as batch, time, heads, head_dim")
    B, T, H, D = q.shape
    if k.dim() != 4 or k.shape[0] != B or k.shape[3] != D:
        raise _shape_error("k", k, f"[{B}, S, KV, {D}]", "keys share batch and head_dim with q")
    if v.shape != k.shape:
        raise _shape_error("v", v, f"{tuple(k.shape)} (the shape of k)", "values and keys must have the same shape")
    S, KV = k.shape[1], k.shape[2]
    if KV == 0 or H % KV:
        raise ValueError(
            f"attention: q has {H} heads and k/v have {KV}; the query heads must be a multiple of the "
            f"key/value heads (GQA/MQA); repeat or regroup heads so that {H} % KV == 0"
        )
    if T > S:
        raise ValueError(
            f"attention: q has T={T} positions but k/v only S={S}; queries are the last T of the S key "
            f"positions, so pass T <= S"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"attention: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); cast them to one dtype")
    if mask is not None:
        ok = (
            mask.dim() == 4
            and mask.shape[0] in (1, B)
            and mask.shape[1] in (1, H)
            and mask.shape[2] in (1, T)  # 1: a key-padding mask [B, 1, 1, S], the same for every query
            and mask.shape[3] == S
        )
        if not ok:
            raise _shape_error("mask", mask, f"[{B}|1, {H}|1, {T}|1, {S}]",
                               "broadcast batch, heads and queries with size 1 (a key-padding mask is [B, 1, 1, S])")
        if mask.dtype != torch.bool and not mask.is_floating_point():
            raise TypeError(
                f"attention: `mask` has dtype {mask.dtype}; pass a bool mask (True = attend) or an additive float mask"
            )
    if document_ids is not None:
        if T != S:
            raise ValueError(
                f"attention: `document_ids` needs T == S (packed training sequences), got T={T}, S={S}; "
                f"drop document_ids when decoding with a cache"
            )
        if tuple(document_ids.shape) != (B, T):
            raise _shape_error("document_ids", document_ids, f"[{B}, {T}]", "one document id per token")
    if window is not None and window < 1:
        raise ValueError(f"attention: `window` must be >= 1 (keys with q_pos - k_pos >= window are masked), got {window}")
    if scale is None:
        scale = D**-0.5
    return AttentionArgs(B, T, S, H, KV, D, float(scale))


def check_paged(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> tuple[int, int, int, int, int, int]:
    """Validate the ``paged_attention`` contract; returns (B, Tq, H, KV, Dh, block_size)."""
    if q.dim() != 4:
        raise _shape_error("q", q, "[B, Tq, H, Dh]", "pass queries as batch, query tokens, heads, head_dim")
    B, Tq, H, D = q.shape
    if k_pool.dim() != 4 or k_pool.shape[3] != D:
        raise _shape_error("k_pool", k_pool, f"[num_blocks, block_size, KV, {D}]", "pass the cache's kv_pool(layer)")
    if v_pool.shape != k_pool.shape:
        raise _shape_error("v_pool", v_pool, f"{tuple(k_pool.shape)} (the shape of k_pool)", "keys and values share one layout")
    KV, block_size = k_pool.shape[2], k_pool.shape[1]
    if KV == 0 or H % KV:
        raise ValueError(f"paged_attention: q has {H} heads and the pool {KV}; H must be a multiple of KV (GQA)")
    if block_tables.dim() != 2 or block_tables.shape[0] != B:
        raise _shape_error("block_tables", block_tables, f"[{B}, max_blocks]", "use cache.block_table(seq_ids)")
    if tuple(context_lens.shape) != (B,):
        raise _shape_error("context_lens", context_lens, f"[{B}]", "one length per sequence")
    if block_tables.dtype not in (torch.int32, torch.int64) or context_lens.dtype not in (torch.int32, torch.int64):
        raise TypeError(
            f"paged_attention: block_tables/context_lens must be int32 (got {block_tables.dtype}, {context_lens.dtype}); "
            f"cast with .to(torch.int32)"
        )
    if q.dtype != k_pool.dtype or k_pool.dtype != v_pool.dtype:
        raise TypeError(f"paged_attention: q, k_pool, v_pool dtypes differ ({q.dtype}, {k_pool.dtype}, {v_pool.dtype})")
    return B, Tq, H, KV, D, block_size


#: storage dtypes of quantised pools (``paged_attention_quant``)
QUANT_POOL_DTYPES = (torch.int8, torch.float8_e4m3fn)


def check_paged_quant(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> tuple[int, int, int, int, int, int]:
    """Validate the ``paged_attention_quant`` contract; returns (B, Tq, H, KV, Dh, block_size).

    As ``check_paged``, except that the pools hold int8 or float8_e4m3fn (q is a float dtype) and each has a
    float32 scale pool ``[num_blocks, block_size, KV]`` (one scale per token and key/value head).
    """
    if k_pool.dtype not in QUANT_POOL_DTYPES or v_pool.dtype != k_pool.dtype:
        raise TypeError(
            f"paged_attention_quant: k_pool/v_pool must both be int8 or float8_e4m3fn (got {k_pool.dtype}, "
            f"{v_pool.dtype}); pass a quantised cache's pools, or use paged_attention for float pools"
        )
    if not q.is_floating_point() or q.dtype in QUANT_POOL_DTYPES:
        raise TypeError(f"paged_attention_quant: q must be a float tensor (got {q.dtype}); pass the model's queries")
    # the shape checks of check_paged, on float views of the same sizes
    probe = torch.empty((1, 1, 1, 1), dtype=q.dtype, device=k_pool.device).expand(*k_pool.shape)  # no memory
    dims = check_paged(q, probe, probe, block_tables, context_lens)
    if v_pool.shape != k_pool.shape:
        raise _shape_error("v_pool", v_pool, f"{tuple(k_pool.shape)} (the shape of k_pool)", "keys and values share one layout")
    for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
        if sc.dtype != torch.float32 or tuple(sc.shape) != tuple(k_pool.shape[:3]):
            raise ValueError(
                f"paged_attention_quant: `{name}` is {sc.dtype} {tuple(sc.shape)}, expected float32 "
                f"{tuple(k_pool.shape[:3])} (num_blocks, block_size, KV); pass the cache's kv_scales(layer)"
            )
        if sc.stride(-1) != 1:
            raise ValueError(f"paged_attention_quant: `{name}` needs a unit stride on KV; call .contiguous() on it")
    return dims
