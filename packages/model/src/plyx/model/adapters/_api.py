"""Adding, switching, merging and training named adapters on a model.

The model keeps one ``_AdapterState`` (configs by name, the active and the merged adapter); every
targeted ``nn.Linear`` becomes a ``LoraLinear`` holding the adapters that target it. Functions take
the model (any ``nn.Module``; plyx's ``TransformerLM`` in practice), so train, rl, serve and export
share one implementation.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import torch
from plyx.model.adapters._config import LoraConfig, matches_target
from plyx.model.adapters._errors import AdapterError
from plyx.model.adapters._layer import LoraLinear
from plyx.model.adapters._variants import get_variant
from torch import nn

__all__ = [
    "active_adapter",
    "adapter_config",
    "adapter_layers",
    "adapter_state_dict",
    "add_adapter",
    "delete_adapter",
    "disable_adapters",
    "list_adapters",
    "lora_plus_param_groups",
    "mark_only_adapters_trainable",
    "merge_adapter",
    "merge_and_unload",
    "set_adapter",
    "unmerge_adapter",
]

#: modules whose weight is read directly (not through their forward) by the loss and the decoders
#: (``TransformerLM.lm_head_weight`` feeds linear_cross_entropy and the serving engine)
_WEIGHT_READ_DIRECTLY = ("lm_head",)
_NAME = re.compile(r"[A-Za-z0-9_-]+")


class _AdapterState:
    """What a model knows of its adapters: configs in insertion order, the active and the merged one."""

    def __init__(self) -> None:
        self.configs: dict[str, LoraConfig] = {}
        self.active: str | None = None
        self.merged: str | None = None


def _state(model: nn.Module, *, create: bool = False) -> _AdapterState:
    state = model.__dict__.get("_plyx_adapters")
    if state is None:
        state = _AdapterState()
        if create:
            model.__dict__["_plyx_adapters"] = state  # not a Module/Parameter: kept out of state_dict
    return state


def adapter_layers(model: nn.Module) -> dict[str, LoraLinear]:
    """Every ``LoraLinear`` of ``model`` by module path (``layers.0.self_attn.q_proj``)."""
    return {path: m for path, m in model.named_modules() if isinstance(m, LoraLinear)}


def _known(model: nn.Module, name: str) -> LoraConfig:
    state = _state(model)
    if name not in state.configs:
        have = ", ".join(state.configs) or "none"
        raise AdapterError(f"adapter {name!r} is not on this model (adapters: {have}); add it with add_adapter first")
    return state.configs[name]


def _targets(model: nn.Module, config: LoraConfig) -> dict[str, nn.Linear]:
    """The linears ``config.target_modules`` selects, by path; errors for no match or a non-linear match."""
    wrapped = [p + "." for p, m in model.named_modules() if isinstance(m, LoraLinear)]
    linears: dict[str, nn.Linear] = {}
    found: dict[str, nn.Module] = {}
    for path, module in model.named_modules():
        if not path or any(path.startswith(w) for w in wrapped):
            continue  # the root, and an adapter's own A/B linears
        if isinstance(module, nn.Linear):
            linears[path] = module
        if matches_target(path, config.target_modules):
            found[path] = module
    if not found:
        names = sorted({p.rsplit(".", 1)[-1] for p in linears})
        raise AdapterError(
            f"target_modules {list(config.target_modules)} matched no module of {type(model).__name__}; "
            f"its linear modules are named {names} (e.g. {next(iter(linears), '-')!r}); "
            f"use those names, or 're:<regex>' matching a full path"
        )
    refused = [p for p in found if p.rsplit(".", 1)[-1] in _WEIGHT_READ_DIRECTLY]
    if refused:
        raise AdapterError(
            f"target_modules {list(config.target_modules)} selects {refused}, whose weight the loss and the decoders "
            f"read directly (lm_head_weight), so an adapter there would be ignored; target the decoder layers' "
            f"projections (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj) instead"
        )
    other = [f"{p} ({type(m).__name__})" for p, m in found.items() if not isinstance(m, nn.Linear)]
    if other:
        raise AdapterError(
            f"target_modules {list(config.target_modules)} selects modules that are not nn.Linear: {other[:5]}; "
            f"adapters wrap linears only: narrow the pattern to the projections"
        )
    return found  # type: ignore[return-value]  # every one an nn.Linear, checked above


def add_adapter(model: nn.Module, config: LoraConfig, name: str = "default") -> None:
    """Add adapter ``name`` to the linears ``config.target_modules`` selects.

    The first adapter added becomes the active one; later ones wait for ``set_adapter``. The base
    parameters keep their ``requires_grad`` (``mark_only_adapters_trainable`` freezes them).

    Args:
        model: the model (its targeted ``nn.Linear`` modules become ``LoraLinear`` in place).
        config: the adapter's ``LoraConfig``.
        name: letters, digits, ``_`` or ``-``; unique on the model.

    Raises:
        AdapterError: a taken or malformed name, an unknown variant, patterns that match nothing
            (the message lists the model's linear names), a non-linear or ``lm_head`` target.
    """
    if not isinstance(config, LoraConfig):
        raise AdapterError(f"add_adapter needs a LoraConfig (got {type(config).__name__}); build one with LoraConfig(r=...)")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise AdapterError(f"adapter name {name!r} must be letters, digits, '_' or '-' (it becomes a parameter name)")
    state = _state(model, create=True)
    if name in state.configs:
        raise AdapterError(f"an adapter named {name!r} is on this model already; pick another name or delete_adapter it")
    variant = get_variant(config.variant)
    targets = _targets(model, config)  # every check before the first change
    for path, linear in targets.items():
        layer = linear if isinstance(linear, LoraLinear) else LoraLinear.wrap(linear)
        if layer is not linear:
            parent_path, _, attr = path.rpartition(".")
            setattr(model.get_submodule(parent_path), attr, layer)
        layer.add(name, config, variant)
    state.configs[name] = config
    if state.active is None:
        set_adapter(model, name)


def set_adapter(model: nn.Module, name: str) -> None:
    """Make ``name`` the one active adapter (layers it does not target run their base weight)."""
    _known(model, name)
    state = _state(model)
    if state.merged is not None and state.merged != name:
        raise AdapterError(
            f"adapter {state.merged!r} is merged into the base weights; unmerge_adapter(model) before switching to {name!r}"
        )
    for layer in adapter_layers(model).values():
        layer.active = name if name in layer.variants else None
    state.active = name


def active_adapter(model: nn.Module) -> str | None:
    """The active adapter's name (None: no adapter)."""
    return _state(model).active


def list_adapters(model: nn.Module) -> list[str]:
    """Adapter names, in the order they were added."""
    return list(_state(model).configs)


def adapter_config(model: nn.Module, name: str | None = None) -> LoraConfig:
    """The ``LoraConfig`` of adapter ``name`` (default: the active one)."""
    return _known(model, _name_or_active(model, name))


def _name_or_active(model: nn.Module, name: str | None) -> str:
    if name is not None:
        return name
    active = _state(model).active
    if active is None:
        raise AdapterError("the model has no active adapter; add one with add_adapter(model, LoraConfig(...))")
    return active


@contextlib.contextmanager
def disable_adapters(model: nn.Module) -> Iterator[None]:
    """Inside the block the model computes its base output (a merged adapter is unmerged for it and
    merged back after). DPO's reference model without a second copy of the weights."""
    state = _state(model)
    merged = state.merged
    if merged is not None:
        unmerge_adapter(model)
    layers = list(adapter_layers(model).values())
    before = [layer.disabled for layer in layers]
    for layer in layers:
        layer.disabled = True
    try:
        yield
    finally:
        for layer, was in zip(layers, before):
            layer.disabled = was
        if merged is not None:
            merge_adapter(model)


def delete_adapter(model: nn.Module, name: str) -> None:
    """Remove adapter ``name``; a linear left with no adapter becomes a plain ``nn.Linear`` again.
    When it was active, the first remaining adapter (if any) becomes active."""
    _known(model, name)
    state = _state(model)
    if state.merged == name:
        raise AdapterError(f"adapter {name!r} is merged into the base weights; unmerge_adapter(model) before deleting it")
    for path, layer in adapter_layers(model).items():
        if name in layer.variants:
            layer.remove(name)
        if not layer.variants:
            parent_path, _, attr = path.rpartition(".")
            setattr(model.get_submodule(parent_path), attr, layer.unwrap())
    del state.configs[name]
    if state.active == name:
        state.active = None
        if state.configs:
            set_adapter(model, next(iter(state.configs)))


def merge_adapter(model: nn.Module) -> None:
    """Fold the active adapter into the base weights in place (inference at base speed; packed and
    fused decode paths read the weights directly again). ``unmerge_adapter`` undoes it."""
    state = _state(model)
    name = _name_or_active(model, None)
    if state.merged == name:
        return
    for layer in adapter_layers(model).values():
        if layer.active == name:
            layer.variants[name].merge(layer, name)
            layer.merged = name
    state.merged = name


def unmerge_adapter(model: nn.Module) -> None:
    """Subtract the merged adapter from the base weights (nothing when none is merged)."""
    state = _state(model)
    name = state.merged
    if name is None:
        return
    for layer in adapter_layers(model).values():
        if layer.merged == name:
            layer.variants[name].unmerge(layer, name)
            layer.merged = None
    state.merged = None


def merge_and_unload(model: nn.Module) -> nn.Module:
    """Merge the active adapter (if not merged yet) and drop every adapter: the plain model, for
    ``save_hf``, checkpoints, export and serving. Returns ``model`` (changed in place)."""
    state = _state(model)
    if state.active is not None:
        merge_adapter(model)
    for path, layer in adapter_layers(model).items():
        parent_path, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent_path), attr, layer.unwrap())
    model.__dict__.pop("_plyx_adapters", None)
    return model


def adapter_state_dict(model: nn.Module, name: str | None = None) -> dict[str, torch.Tensor]:
    """Adapter ``name``'s tensors (default: the active one) under plyx module paths and PEFT's tensor
    names: ``layers.0.self_attn.q_proj.lora_A.weight``, ``...lora_B.weight``, ``...lora_magnitude_vector``.
    The tensors are the parameters' data (detached, not copied)."""
    name = _name_or_active(model, name)
    _known(model, name)
    out: dict[str, torch.Tensor] = {}
    for path, layer in adapter_layers(model).items():
        if name in layer.variants:
            for key, p in layer.adapter_tensors(name).items():
                out[f"{path}.{key}"] = p.detach()
    return out


def _adapter_params(model: nn.Module, name: str) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(A-side, B-side)`` parameters of adapter ``name``: B-side is ``lora_B`` and the variant's own vectors."""
    a_side: list[nn.Parameter] = []
    b_side: list[nn.Parameter] = []
    for layer in adapter_layers(model).values():
        if name in layer.variants:
            for key, p in layer.adapter_tensors(name).items():
                (a_side if key.startswith("lora_A") else b_side).append(p)  # type: ignore[arg-type]
    return a_side, b_side


def mark_only_adapters_trainable(model: nn.Module, name: str | None = None) -> int:
    """Freeze every parameter but adapter ``name``'s (default: the active one).

    Returns:
        the number of trainable parameter elements left.
    """
    name = _name_or_active(model, name)
    _known(model, name)
    for p in model.parameters():
        p.requires_grad_(False)
    a_side, b_side = _adapter_params(model, name)
    for p in a_side + b_side:
        p.requires_grad_(True)
    return sum(p.numel() for p in a_side + b_side)


def lora_plus_param_groups(model: nn.Module, lr: float, *, weight_decay: float = 0.0,
                           ratio: float | None = None) -> list[dict[str, Any]]:
    """Optimizer parameter groups of the trainable parameters, LoRA+ aware (Hayou et al. 2024, PEFT's
    ``create_loraplus_optimizer``): ``B`` (and the variant's own vectors, e.g. DoRA's magnitude) at
    ``lr * ratio``, everything else at ``lr``; vectors outside adapters (norms, biases) without decay.

    Args:
        model: the model; only parameters with ``requires_grad`` are grouped.
        lr: the base learning rate (of ``A``).
        weight_decay: decay of matrices and of adapter vectors.
        ratio: ``lr_B / lr_A``; default the active adapter's ``lora_plus_ratio`` (1.0 when that is None).

    Returns:
        non-empty groups among ``lora_A``, ``lora_B``, ``base``, ``base_no_decay`` (each dict has
        ``params``, ``lr``, ``weight_decay`` and ``name``).
    """
    if ratio is None:
        active = _state(model).active
        ratio = _known(model, active).lora_plus_ratio if active is not None else None
        ratio = 1.0 if ratio is None else ratio
    if not ratio > 0:
        raise AdapterError(f"lora_plus_param_groups: ratio must be > 0 (got {ratio!r}); the LoRA+ paper uses 16")
    a_ids: set[int] = set()
    b_ids: set[int] = set()
    for name in _state(model).configs:
        a_side, b_side = _adapter_params(model, name)
        a_ids.update(map(id, a_side))
        b_ids.update(map(id, b_side))
    groups: dict[str, list[nn.Parameter]] = {"lora_A": [], "lora_B": [], "base": [], "base_no_decay": []}
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if id(p) in b_ids:
            groups["lora_B"].append(p)
        elif id(p) in a_ids:
            groups["lora_A"].append(p)
        else:
            groups["base" if p.dim() >= 2 else "base_no_decay"].append(p)
    settings = {"lora_A": (lr, weight_decay), "lora_B": (lr * ratio, weight_decay),
                "base": (lr, weight_decay), "base_no_decay": (lr, 0.0)}
    return [{"params": ps, "lr": settings[k][0], "weight_decay": settings[k][1], "name": k}
            for k, ps in groups.items() if ps]
