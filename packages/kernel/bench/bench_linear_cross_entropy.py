"""Fused linear cross-entropy: CE_TOKENS x HIDDEN hidden states, VOCAB x HIDDEN lm-head, bfloat16."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _harness import Case
from bench_cross_entropy import unit_grad
from shapes import CE_TOKENS, HIDDEN, LCE_CHUNK_ALTERNATIVES, VOCAB


def _torch(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(h, w).float(), t)  # holds [N, V] logits in bf16 and float32


def cases() -> list[Case]:
    from plyx.kernel.triton_ops.linear_cross_entropy import linear_cross_entropy

    n, d, v = CE_TOKENS, HIDDEN, VOCAB

    def inputs() -> dict[str, torch.Tensor]:
        return {"h": torch.randn(n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True),
                "w": (torch.randn(v, d, device="cuda") * d**-0.5).to(torch.bfloat16).requires_grad_(True),
                "t": torch.randint(0, v, (n,), device="cuda")}

    def liger(i: dict[str, torch.Tensor]):
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

        def run():
            out = LigerFusedLinearCrossEntropyFunction.apply(i["h"], i["w"], i["t"])
            return out[0] if isinstance(out, tuple) else out
        return run

    from plyx.kernel.triton_ops import linear_cross_entropy as module

    def plyx(chunk: int | None, overlap: bool = False):
        def build(i: dict[str, torch.Tensor]):
            def run():
                old = dict(module.SCHEDULE)
                module.SCHEDULE.update(overlap=overlap)
                try:
                    return linear_cross_entropy(i["h"], i["w"], i["t"], chunk_size=chunk)
                finally:
                    module.SCHEDULE.update(old)
            return run
        return build

    compiled = torch.compile(_torch)
    # g=1: loss.backward()'s incoming gradient (the backward's rescale of d_weight is then skipped); first, so a
    # short --budget-s still measures them
    providers = {"plyx": plyx(None), "plyx g=1": unit_grad(plyx(None)), "plyx chunk=256 g=1": unit_grad(plyx(256)),
                 "liger g=1": unit_grad(liger),
                 # the d_weight update on a side stream beside the d_hidden GEMM (SCHEDULE["overlap"])
                 "plyx overlap g=1": unit_grad(plyx(None, True)), "plyx overlap chunk=256 g=1": unit_grad(plyx(256, True))}
    for chunk in LCE_CHUNK_ALTERNATIVES:
        providers[f"plyx chunk={chunk}"] = plyx(chunk)
    providers.update({
        "torch": lambda i: lambda: _torch(i["h"], i["w"], i["t"]),
        "torch.compile": lambda i: lambda: compiled(i["h"], i["w"], i["t"]),
        "liger": liger,
    })
    flops = 2 * n * d * v
    return [Case("linear_cross_entropy", f"{n}x{d} @ {v}", inputs, providers, grad=("h", "w"), graph=False,
                 floor={"fwd": ("flops", flops), "fwd+bwd": ("flops", 3 * flops)})]
