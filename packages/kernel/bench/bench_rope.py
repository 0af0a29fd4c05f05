"""RoPE of q and k (GQA) at BATCH x SEQ tokens, HEADS/KV_HEADS x HEAD_DIM, bfloat16.

Every provider gets q and k as the projections produce them, ``[B, T, H, Dh]``
contiguous (torch and Liger see the ``[B, H, T, Dh]`` transposed view, as in
Hugging Face's attention); ``plyx`` rotates q and k in one launch (``rope_qk``, what the model calls),
``plyx (rope x2)`` with one ``rope`` launch each (before plyx-kernel 1.4).
"""

from __future__ import annotations

import torch
from _harness import Case
from shapes import BATCH, HEAD_DIM, HEADS, KV_HEADS, SEQ


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _torch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Hugging Face's apply_rotary_pos_emb on [B, H, T, Dh] views; cos/sin [1, T, Dh] (duplicated halves)
    c, s = cos[:, None], sin[:, None]
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s


def cases() -> list[Case]:
    from plyx.kernel import rope_tables
    from plyx.kernel.triton_ops.rope import rope
    from plyx.kernel.triton_ops.rope_qk import rope_qk

    b, t, h, kv, d = BATCH, SEQ, HEADS, KV_HEADS, HEAD_DIM

    def inputs() -> dict[str, torch.Tensor]:
        cos, sin = rope_tables(torch.arange(t, device="cuda"), d, 500000.0, dtype=torch.bfloat16)  # [T, Dh/2]
        return {"q": torch.randn(b, t, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True),
                "k": torch.randn(b, t, kv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True),
                "cos": cos, "sin": sin,
                "cos_full": torch.cat((cos, cos), -1)[None].contiguous(), "sin_full": torch.cat((sin, sin), -1)[None].contiguous()}

    def liger(i: dict[str, torch.Tensor]):
        from liger_kernel.ops.rope import LigerRopeFunction

        return lambda: LigerRopeFunction.apply(i["q"].transpose(1, 2), i["k"].transpose(1, 2), i["cos_full"], i["sin_full"])

    compiled = torch.compile(_torch)
    size = (b * t * h * d + b * t * kv * d) * 2
    return [Case("rope q+k", f"{b}x{t}x({h}+{kv})x{d}", inputs, {
        "plyx": lambda i: lambda: rope_qk(i["q"], i["k"], i["cos"], i["sin"]),
        "plyx (rope x2)": lambda i: lambda: (rope(i["q"], i["cos"], i["sin"]), rope(i["k"], i["cos"], i["sin"])),
        "torch": lambda i: lambda: _torch(i["q"].transpose(1, 2), i["k"].transpose(1, 2), i["cos_full"], i["sin_full"]),
        "torch.compile": lambda i: lambda: compiled(i["q"].transpose(1, 2), i["k"].transpose(1, 2), i["cos_full"], i["sin_full"]),
        "liger": liger,
    }, grad=("q", "k"), floor={"fwd": ("bytes", 2 * size), "fwd+bwd": ("bytes", 4 * size)})]
