"""Matmul square bfloat16 at MATMUL_SIZES: Triton tiled GEMM against torch.matmul (cuBLAS)."""

from __future__ import annotations

import torch
from _harness import Case
from shapes import MATMUL_SIZES


def cases() -> list[Case]:
    from plyx.kernel.triton_ops import matmul as module
    from plyx.kernel.triton_ops.matmul import matmul

    def copied(i: dict[str, torch.Tensor]):
        def run():  # the backward copies its transposed operands to row-major first
            module.CONTIGUOUS_BACKWARD["on"] = True
            try:
                return matmul(i["a"], i["b"])
            finally:
                module.CONTIGUOUS_BACKWARD["on"] = False
        return run

    out = []
    for s in MATMUL_SIZES:
        def inputs(s: int = s) -> dict[str, torch.Tensor]:
            return {k: (torch.randn(s, s, device="cuda") * s**-0.25).to(torch.bfloat16).requires_grad_(True) for k in "ab"}

        out.append(Case("matmul", f"{s}x{s}x{s}", inputs, {
            "plyx": lambda i: lambda: matmul(i["a"], i["b"]),
            "plyx copied-bwd": copied,
            "torch": lambda i: lambda: torch.matmul(i["a"], i["b"]),
        }, grad=("a", "b"), floor={"fwd": ("flops", 2 * s**3), "fwd+bwd": ("flops", 6 * s**3)}))
    return out
