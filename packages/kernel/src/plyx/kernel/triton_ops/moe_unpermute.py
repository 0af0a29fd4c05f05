"""Triton ``moe_unpermute``: ``out[t] = sum_j weights[t, j] * ys[positions[t, j]]``, forward and backward.

Forward: ``gather_rows`` with the weights (float32 sums). Backward, one ``scatter_rows`` launch:
``dys[positions[t, j]] = weights[t, j] * dout[t]`` and ``dweights[t, j] = <dout[t], ys[positions[t, j]]>``.
"""

from __future__ import annotations

from typing import Any

import torch
from plyx.kernel.reference.moe_unpermute import check_moe_unpermute
from plyx.kernel.triton_ops._moe_rows import gather_rows, scatter_rows

__all__ = ["moe_unpermute"]

_NAME = "moe_unpermute:triton"


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, ys: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        ys = ys.contiguous()
        ctx.save_for_backward(ys, positions, weights)
        return gather_rows(ys, positions, weights)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> Any:
        ys, positions, weights = ctx.saved_tensors
        need_w = ctx.needs_input_grad[2]
        dys, dw = scatter_rows(dout.contiguous(), positions, weights, other=ys if need_w else None)
        return dys, None, dw.to(weights.dtype) if dw is not None else None


def moe_unpermute(ys: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Same contract as ``plyx.kernel.reference.moe_unpermute``."""
    check_moe_unpermute(_NAME, ys, positions, weights)
    return _Unpermute.apply(ys, positions, weights)
