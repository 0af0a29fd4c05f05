"""Packed projections: linears that read the same input, their weights stacked in one buffer.

At batch 1 a decode step is memory-bound GEMVs, and small ones (the k and v
projections of a GQA layer are 1 MB each at 1B scale) do not reach the GPU's
bandwidth: one GEMV over the stacked ``[q; k; v]`` rows does (vLLM's
``QKVParallelLinear`` and ``MergedColumnParallelLinear``). ``pack_linears_``
moves each weight into a shared buffer in place (``param.data`` becomes a row
slice of it): names, values, ``state_dict`` and optimizers see the same
parameters, and no second copy is kept. ``packed_linear`` finds the stacked
view again, and says None as soon as a parameter was replaced or moved
(``.to()``, ``load_state_dict(assign=True)``): the caller then runs the linears
one by one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

__all__ = ["pack_linears_", "packed_for_inference", "packed_linear", "stacked_for_training", "weight_reads_exact"]


@torch.no_grad()
def pack_linears_(linears: Sequence[nn.Linear]) -> None:
    """Stack the weights (and biases, when all have one) of ``linears`` in one buffer each, in order."""
    if _stacked_params(linears) is not None:
        return  # already packed
    for attr in ("weight", "bias"):
        params = [getattr(lin, attr) for lin in linears]
        if any(p is None for p in params):
            continue
        buffer = torch.cat([p.detach() for p in params])
        start = 0
        for p in params:
            rows = p.shape[0]
            p.data = buffer[start:start + rows]
            start += rows


def _stacked(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The view covering ``tensors`` when they lie back to back in one storage, else None."""
    first = tensors[0]
    storage = first.untyped_storage().data_ptr()
    expected = first.data_ptr()
    for t in tensors:
        # one storage, not merely adjacent addresses: the allocator may place separate tensors back to back
        if (t.untyped_storage().data_ptr() != storage or t.data_ptr() != expected or not t.is_contiguous()
                or t.dtype != first.dtype or t.shape[1:] != first.shape[1:]):
            return None
        expected += t.numel() * t.element_size()
    rows = sum(t.shape[0] for t in tensors)
    return first.detach().as_strided((rows, *first.shape[1:]), first.stride())


def packed_linear(linears: Sequence[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(weight, bias)`` stacked views of linears packed by ``pack_linears_`` (None: not packed now).

    The views carry no autograd history: use them where no gradient is needed (decode steps).
    None too when a linear's output is not its weight's alone (``weight_reads_exact``: e.g. an unmerged adapter).
    """
    if not all(weight_reads_exact(lin) for lin in linears):
        return None
    return _stacked_params(linears)


def _stacked_params(linears: Sequence[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(weight, bias)`` stacked views when the linears' parameters lie packed, whatever the linears compute."""
    weight = _stacked([lin.weight for lin in linears])
    if weight is None:
        return None
    biases = [lin.bias for lin in linears]
    if all(b is None for b in biases):
        return weight, None
    if any(b is None for b in biases):
        return None
    bias = _stacked(biases)  # type: ignore[arg-type]
    return (weight, bias) if bias is not None else None


def weight_reads_exact(linear: nn.Module) -> bool:
    """Whether ``F.linear(x, linear.weight, linear.bias)`` is ``linear(x)``, so fused paths may read the weight.

    A plain ``nn.Linear`` is; a subclass says so through ``weight_is_effective`` (plyx-model's ``LoraLinear``:
    True when no adapter is active or it is merged); any other module is taken not to be.
    """
    if type(linear) is nn.Linear:
        return True
    return bool(getattr(linear, "weight_is_effective", False))


def packed_for_inference(linears: Sequence[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``packed_linear``, or None when this call could need gradients (the stacked views have no history)."""
    if torch.is_grad_enabled() and any(p.requires_grad for lin in linears for p in lin.parameters()):
        return None
    return packed_linear(linears)


def stacked_for_training(linears: Sequence[nn.Module], x: torch.Tensor, *,
                         arrange: Callable[[int, torch.Tensor], torch.Tensor] | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(weight, bias)`` of ``linears`` concatenated along their output rows, with autograd history, for one GEMM
    over an input they all read (nanoGPT's ``c_attn``): ``F.linear(x, *stacked)`` is the linears' outputs side by
    side, and its backward hands each parameter its own row slice of the one weight gradient.

    Taken for a training forward on CPU, where each GEMM and its two backward GEMMs are dispatched ops of a
    step that runs a few hundred (nanoGPT's CPU recipe: one ``[768, 128] x [128, 384]`` GEMM per layer instead of
    three of ``[128, 128]``; issue 20). None elsewhere (the caller runs the linears one by one): no gradient
    wanted, ``torch.compile``/export tracing, another device, a linear whose output is not its weight's alone
    (``weight_reads_exact``), one with hooks, or parameters that are tensor subclasses (e.g. DTensor shards).

    Args:
        linears: the projections, in the order their outputs are wanted.
        x: the input they read (its device and whether a gradient is being recorded decide).
        arrange: ``arrange(i, t)`` reorders the output rows of linear ``i``'s weight or bias ``t`` before they are
            stacked (e.g. RoPE's pairs side by side); differentiable ops only.

    Returns:
        ``(weight [sum of out_features, in], bias or None)``, or None.
    """
    if x.device.type != "cpu" or not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return None
    weights, biases = [], []
    for lin in linears:
        if type(lin) is not nn.Linear or lin._forward_hooks or lin._forward_pre_hooks:
            return None
        weights.append(lin.weight)
        biases.append(lin.bias)
    if not any(w.requires_grad for w in weights) or any(type(w) is not nn.Parameter for w in weights):
        return None
    if any(b is None for b in biases) and not all(b is None for b in biases):
        return None
    if any(b is not None and type(b) is not nn.Parameter for b in biases):
        return None
    if arrange is not None:
        weights = [arrange(i, w) for i, w in enumerate(weights)]
        biases = [None if b is None else arrange(i, b) for i, b in enumerate(biases)]
    return torch.cat(weights), (None if biases[0] is None else torch.cat(biases))  # type: ignore[arg-type]
