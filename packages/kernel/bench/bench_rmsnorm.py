"""RMSNorm (and RMSNorm with the residual add fused) at TOKENS x HIDDEN, bfloat16."""

from __future__ import annotations

import torch
from _harness import Case
from shapes import EPS, HIDDEN, TOKENS


def _torch(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype) * w


def _torch_residual(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = x + r
    return _torch(h, w), h


def cases() -> list[Case]:
    from plyx.kernel.triton_ops.rmsnorm import rmsnorm

    n, d = TOKENS, HIDDEN

    def inputs() -> dict[str, torch.Tensor]:
        return {"x": torch.randn(n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True),
                "r": torch.randn(n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True),
                "w": (1 + 0.1 * torch.randn(d, device="cuda")).to(torch.bfloat16).requires_grad_(True)}

    def liger(i: dict[str, torch.Tensor]):
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        return lambda: LigerRMSNormFunction.apply(i["x"], i["w"], EPS, 0.0, "llama", False)

    compiled = torch.compile(_torch)
    compiled_res = torch.compile(_torch_residual)
    size = n * d * 2
    plain = Case("rmsnorm", f"{n}x{d}", inputs, {
        "plyx": lambda i: lambda: rmsnorm(i["x"], i["w"], eps=EPS),
        "torch": lambda i: lambda: _torch(i["x"], i["w"]),
        "torch.compile": lambda i: lambda: compiled(i["x"], i["w"]),
        "liger": liger,
    }, grad=("x", "w"), floor={"fwd": ("bytes", 2 * size), "fwd+bwd": ("bytes", 5 * size)})
    # fused residual: read x, r; write y, h | backward: read dy, dh, h; write dx (= dr)
    residual = Case("rmsnorm+residual", f"{n}x{d}", inputs, {
        "plyx": lambda i: lambda: rmsnorm(i["x"], i["w"], eps=EPS, residual=i["r"]),
        "torch": lambda i: lambda: _torch_residual(i["x"], i["r"], i["w"]),
        "torch.compile": lambda i: lambda: compiled_res(i["x"], i["r"], i["w"]),
    }, grad=("x", "r", "w"), floor={"fwd": ("bytes", 4 * size), "fwd+bwd": ("bytes", 8 * size)})
    return [plain, residual]
