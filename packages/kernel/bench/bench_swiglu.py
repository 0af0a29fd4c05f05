"""SwiGLU silu(gate) * up at SWIGLU_TOKENS x FFN, bfloat16."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _harness import Case
from shapes import FFN, SWIGLU_TOKENS


def _torch(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return F.silu(g) * u


def cases() -> list[Case]:
    from plyx.kernel.triton_ops.swiglu import swiglu

    n, f = SWIGLU_TOKENS, FFN

    def inputs() -> dict[str, torch.Tensor]:
        return {k: torch.randn(n, f, device="cuda", dtype=torch.bfloat16, requires_grad=True) for k in ("g", "u")}

    def liger(i: dict[str, torch.Tensor]):
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        return lambda: LigerSiLUMulFunction.apply(i["g"], i["u"])

    from plyx.kernel.triton_ops import swiglu as module

    def variant(block: int, warps: int):
        def build(i: dict[str, torch.Tensor]):
            def run():  # the launch config is read in forward and kept for the backward
                old = dict(module.LAUNCH)
                module.LAUNCH.update(block=block, warps=warps)
                try:
                    return swiglu(i["g"], i["u"])
                finally:
                    module.LAUNCH.update(old)
            return run
        return build

    compiled = torch.compile(_torch)
    size = n * f * 2
    return [Case("swiglu", f"{n}x{f}", inputs, {
        "plyx": lambda i: lambda: swiglu(i["g"], i["u"]),
        "torch": lambda i: lambda: _torch(i["g"], i["u"]),
        "torch.compile": lambda i: lambda: compiled(i["g"], i["u"]),
        "liger": liger,
        "plyx block=1024/4w": variant(1024, 4),
        "plyx block=4096/8w": variant(4096, 8),
    }, grad=("g", "u"), floor={"fwd": ("bytes", 3 * size), "fwd+bwd": ("bytes", 8 * size)})]
