"""``rope(x, cos, sin, *, interleaved=False)``: rotary position embedding of the first R dims (reference).

x is ``[B, T, H, Dh]``; cos and sin are ``[T, R/2]`` or ``[B, T, R/2]``, already
gathered at each token's position id (``plyx.kernel.rope_tables`` builds them),
with ``R <= Dh`` (partial rotary leaves dims ``R..Dh`` untouched).

Pair ``i`` (``0 <= i < R/2``) is ``(x[i], x[i + R/2])`` in the rotate-half layout
(Llama / Hugging Face) and ``(x[2i], x[2i+1])`` in the interleaved layout (GPT-J,
Meta's original Llama). Each pair is rotated by the angle ``theta_i``::

    out_a = a * cos - b * sin
    out_b = b * cos + a * sin

The backward is the rotation by ``-theta``: ``da = ga*cos + gb*sin``, ``db = gb*cos - ga*sin``.
"""

from __future__ import annotations

import torch
from plyx.kernel._errors import KernelInputError, check_float, check_same_device, shape_str

__all__ = ["rope", "check_rope"]


def check_rope(kernel: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> int:
    """Validate and return R, the number of rotated dims."""
    check_float(kernel, "x", x)
    check_float(kernel, "cos", cos)
    check_float(kernel, "sin", sin)
    check_same_device(kernel, ("x", x), ("cos", cos), ("sin", sin))
    if x.dim() != 4:
        raise KernelInputError(kernel, "x", f"expected [B, T, H, Dh], got shape {shape_str(x.shape)}",
                               "view the projection as (B, T, n_heads, head_dim)")
    b, t, _, dh = x.shape
    if cos.shape != sin.shape:
        raise KernelInputError(kernel, "sin", f"shape {shape_str(sin.shape)} differs from cos's {shape_str(cos.shape)}",
                               "build both with plyx.kernel.rope_tables")
    ok = (cos.dim() == 2 and cos.shape[0] == t) or (cos.dim() == 3 and cos.shape[0] in (1, b) and cos.shape[1] == t)
    if not ok:
        raise KernelInputError(kernel, "cos", f"expected [T={t}, R/2] or [B={b}, T={t}, R/2], got {shape_str(cos.shape)}",
                               "gather the tables at the position ids of x's tokens (plyx.kernel.rope_tables)")
    rotary = 2 * cos.shape[-1]
    if rotary == 0 or rotary > dh:
        raise KernelInputError(kernel, "cos", f"last dim {cos.shape[-1]} means R={rotary} rotated dims, expected 1 <= R/2 and R <= Dh={dh}",
                               "build the tables with rotary_dim <= head_dim")
    return rotary


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False) -> torch.Tensor:
    rotary = check_rope("rope:reference", x, cos, sin)
    compute = torch.promote_types(x.dtype, torch.float32)
    half = rotary // 2
    c = (cos if cos.dim() == 3 else cos[None]).to(compute)[:, :, None, :]  # (B|1, T, 1, R/2)
    s = (sin if sin.dim() == 3 else sin[None]).to(compute)[:, :, None, :]
    xr = x[..., :rotary].to(compute)  # (B, T, H, R)
    if interleaved:
        a, b = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)
    else:
        a, b = xr[..., :half], xr[..., half:]
        out = torch.cat((a * c - b * s, b * c + a * s), dim=-1)
    return torch.cat((out.to(x.dtype), x[..., rotary:]), dim=-1)
