"""``rope_qk(q, k, cos, sin, *, interleaved=False)``: RoPE of a layer's queries and keys together (reference).

q is ``[B, T, H, Dh]`` and k ``[B, T, KV, Dh]`` (GQA/MQA: ``KV`` may differ from ``H``); both are rotated
by the same tables (``[T, R/2]`` or ``[B, T, R/2]``), exactly as ``rope(q, ...), rope(k, ...)``. The name
exists so that an implementation can do both in one launch (the Triton one does); the math, layouts and
gradient are ``rope``'s (see ``plyx.kernel.reference.rope``).
"""

from __future__ import annotations

import torch
from plyx.kernel._errors import KernelInputError, shape_str
from plyx.kernel.reference.rope import check_rope, half_tables, rope, rotate_pair

__all__ = ["rope_qk", "check_rope_qk"]


def check_rope_qk(kernel: str, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> int:
    """Validate q and k (each as ``rope`` checks x) and that they share batch, tokens and head dim; returns R."""
    rotary = check_rope(kernel, q, cos, sin)
    if k.dim() != 4 or (k.shape[0], k.shape[1], k.shape[3]) != (q.shape[0], q.shape[1], q.shape[3]):
        raise KernelInputError(kernel, "k", f"expected [B, T, KV, Dh] with q's B, T and Dh "
                               f"({shape_str(q.shape)}), got {shape_str(k.shape)}",
                               "view the key projection as (B, T, n_kv_heads, head_dim)")
    check_rope(kernel, k, cos, sin)
    if k.dtype != q.dtype:
        raise KernelInputError(kernel, "k", f"dtype {k.dtype} differs from q's {q.dtype}", "cast both to one dtype")
    return rotary


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
            interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rope(q, cos, sin), rope(k, cos, sin))``: new tensors, q's and k's shapes and dtype."""
    rotary = check_rope_qk("rope_qk:reference", q, k, cos, sin)
    if interleaved:
        return rope(q, cos, sin, interleaved=True), rope(k, cos, sin, interleaved=True)
    tables = half_tables(cos, sin, torch.promote_types(q.dtype, torch.float32))  # built once for q and k
    return rotate_pair(q, k, rotary, tables)
