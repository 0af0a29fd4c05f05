"""Cross-entropy over materialised logits, CE_TOKENS x VOCAB, bfloat16 logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _harness import Case
from shapes import CE_TOKENS, VOCAB


def _torch(z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(z.float(), t)  # what training code does: upcast, then the loss


class _UnitGrad(torch.autograd.Function):
    """Identity whose backward passes exactly 1 whatever arrives: a provider wrapped in it pays in fwd+bwd what
    ``loss.backward()`` pays (the harness differentiates with a random cotangent, a non-unit gradient)."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor) -> torch.Tensor:
        return loss.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(grad)


def unit_grad(build):
    """``build``'s provider with ``loss.backward()``'s incoming gradient of 1 (see ``_UnitGrad``)."""
    def wrapped(i: dict[str, torch.Tensor]):
        fn = build(i)

        def run():
            return _UnitGrad.apply(fn())
        if hasattr(fn, "grad_inputs"):
            run.grad_inputs = fn.grad_inputs
        return run
    return wrapped


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
    def plyx(i: dict[str, torch.Tensor]):
        return lambda: cross_entropy(i["z"], i["t"])

    def torch_compile(i: dict[str, torch.Tensor]):
        return lambda: compiled(i["z"], i["t"])

    return [Case("cross_entropy", f"{n}x{v}", inputs, {
        "plyx": plyx,
        "torch": lambda i: lambda: _torch(i["z"], i["t"]),
        "torch.compile": torch_compile,
        "liger": liger,
        "plyx inplace": inplace,
        # g=1: the incoming gradient of loss.backward() (Liger and the in-place call then skip their rescale)
        "plyx g=1": unit_grad(plyx),
        "plyx inplace g=1": unit_grad(inplace),
        "liger g=1": unit_grad(liger),
        "torch.compile g=1": unit_grad(torch_compile),
        "plyx block=8192/16w": variant(8192, 16),
        "plyx block=32768/32w": variant(32768, 32),
    }, grad=("z",), graph=False, floor={"fwd": ("bytes", size), "fwd+bwd": ("bytes", 2 * size)})]
