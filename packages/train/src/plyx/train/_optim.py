"""Optimizers: parameter groups and the plugin lookup.

Weight decay applies to matrices (linear weights, embeddings) and not to
vectors (norm gains, biases): decaying a norm gain towards 0 shrinks the
activations it scales for no regularisation benefit (nanoGPT's
``configure_optimizers``, from the GPT-3 / Chinchilla recipes).
"""

from __future__ import annotations

from typing import Any

import torch
from plyx.specs import OptimizerConfig, components
from torch import nn

__all__ = ["param_groups", "build_optimizer", "available_optimizers", "adafactor", "adamw", "sgd"]


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups, ``decay`` (ndim >= 2) and ``no_decay`` (ndim < 2), trainable parameters only.

    Tied parameters appear once (``named_parameters`` deduplicates them).
    """
    decay, no_decay = [], []
    for _name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim >= 2:
            decay.append(p)
        else:
            no_decay.append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "group": "decay"}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0, "group": "no_decay"})
    return groups


def _fused_ok(groups: list[dict[str, Any]]) -> bool:
    """torch's fused Adam/SGD kernels exist for CPU and CUDA floating tensors, all on one device type."""
    params = [p for g in groups for p in g["params"]]
    devices = {p.device.type for p in params}
    return len(devices) == 1 and devices <= {"cpu", "cuda"} and all(p.is_floating_point() for p in params)


def adamw(groups: list[dict[str, Any]], config: OptimizerConfig) -> torch.optim.Optimizer:
    """``torch.optim.AdamW``, fused where torch has a fused kernel for the parameters' device."""
    return torch.optim.AdamW(
        groups,
        lr=config.lr,
        betas=tuple(config.betas),
        eps=config.eps,
        weight_decay=config.weight_decay,
        fused=_fused_ok(groups) or None,
    )


def sgd(groups: list[dict[str, Any]], config: OptimizerConfig) -> torch.optim.Optimizer:
    """SGD with Nesterov momentum ``betas[0]``; decoupled from nothing: plain L2 decay as torch does it."""
    return torch.optim.SGD(
        groups,
        lr=config.lr,
        momentum=config.betas[0],
        nesterov=config.betas[0] > 0,
        weight_decay=config.weight_decay,
        fused=_fused_ok(groups) or None,
    )


def adafactor(groups: list[dict[str, Any]], config: OptimizerConfig) -> torch.optim.Optimizer:
    """``torch.optim.Adafactor``: a factored second moment (Shazeer & Stern 2018), no first moment.

    A matrix ``[R, C]`` keeps a row and a column mean of the squared gradients (``R + C`` values) instead
    of AdamW's two ``R x C`` moments; vectors keep a full second moment. The step is torch's: the update
    is scaled by ``max(eps2, RMS(param)) * min(lr, 1/sqrt(t))`` (relative step sizes), so ``optimizer.lr``
    is an upper bound of the relative step, ~1e-2 (torch's default), not an AdamW learning rate; weight
    decay is decoupled (``param *= 1 - lr * weight_decay``), per group (none on norms and biases).
    ``betas`` and ``eps`` (Adam's) are not used: Adafactor's ``beta2_decay`` -0.8 and ``eps`` (None, 1e-3)
    keep torch's defaults.
    """
    return torch.optim.Adafactor(groups, lr=config.lr, weight_decay=config.weight_decay)


def available_optimizers() -> list[str]:
    """Names of every optimizer a plugin provides."""
    return sorted(components("plyx_optimizers"))


def build_optimizer(model: nn.Module, config: OptimizerConfig) -> torch.optim.Optimizer:
    """The optimizer ``config.name`` from the ``plyx_optimizers`` hook, over ``param_groups(model)``.

    Raises:
        LookupError: no plugin provides ``config.name``; the message lists the ones that exist.
    """
    found = components("plyx_optimizers")
    if config.name not in found:
        raise LookupError(
            f"optimizer {config.name!r} not found. It is either misspelled or not installed "
            f"(optimizer.name; available: {', '.join(sorted(found)) or 'none'})"
        )
    return found[config.name].factory(param_groups(model, config.weight_decay), config)
