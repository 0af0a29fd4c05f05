"""Cross-entropy over materialised logits, CE_TOKENS x VOCAB, bfloat16 logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _harness import Case
from shapes import CE_TOKENS, VOCAB


def _torch(z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(z.float(), t)  # what training code does: upcast, then the loss


def cases() -> list[Case]:
    from plyx.kernel.triton_ops.cross_entropy import cross_entropy

    n, v = CE_TOKENS, VOCAB

    def inputs() -> dict[str, torch.Tensor]:
        return {"z": torch.randn(n, v, device="cuda", dtype=torch.bfloat16, requires_grad=True),
                "t": torch.randint(0, v, (n,), device="cuda")}

    def liger(i: dict[str, torch.Tensor]):
        from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction

        # Liger writes the gradient over its input: give it a copy so the other providers see logits
        z = i["z"].detach().clone().requires_grad_(True)

        def run():
            out = LigerCrossEntropyFunction.apply(z, i["t"], None, -100, 0.0, 0.0, "mean")
            return out[0] if isinstance(out, tuple) else out
        run.grad_inputs = [z]
        return run

    def inplace(i: dict[str, torch.Tensor]):
        # as Liger: the gradient is written over the logits in the forward, so it works on its own copy
        z = i["z"].detach().clone().requires_grad_(True)

        def run():
            return cross_entropy(z, i["t"], inplace=True)
        run.grad_inputs = [z]
        return run

    from plyx.kernel.triton_ops import cross_entropy as module

    def variant(block: int, warps: int):
        def build(i: dict[str, torch.Tensor]):
            def run():
                old = dict(module.LAUNCH)
                module.LAUNCH.update(block=block, warps=warps)
                try:
                    return cross_entropy(i["z"], i["t"])
                finally:
                    module.LAUNCH.update(old)
            return run
        return build

    compiled = torch.compile(_torch)
    size = n * v * 2
    return [Case("cross_entropy", f"{n}x{v}", inputs, {
        "plyx": lambda i: lambda: cross_entropy(i["z"], i["t"]),
        "torch": lambda i: lambda: _torch(i["z"], i["t"]),
        "torch.compile": lambda i: lambda: compiled(i["z"], i["t"]),
        "liger": liger,
        "plyx inplace": inplace,
        "plyx block=8192/16w": variant(8192, 16),
        "plyx block=32768/32w": variant(32768, 32),
    }, grad=("z",), graph=False, floor={"fwd": ("bytes", size), "fwd+bwd": ("bytes", 2 * size)})]
