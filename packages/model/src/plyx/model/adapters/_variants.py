"""Adapter variants: how an adapter's ``A``, ``B`` (and its own parameters) change a linear.

Each variant is an ``AdapterVariant``; the built-ins (``lora``, ``rslora``, ``dora``) and any a
third party ships are found through the ``plyx_adapter_variants`` hook (a list of
``plyx.specs.Component`` whose ``factory()`` returns an ``AdapterVariant``), so a new variant
needs no change here. Formulas follow PEFT's ``LoraLayer`` so adapters move between the two.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from plyx.model.adapters._errors import AdapterError
from torch import nn

if TYPE_CHECKING:
    from plyx.model.adapters._layer import LoraLinear

__all__ = ["AdapterVariant", "DoraVariant", "LoraVariant", "RsLoraVariant", "builtin_variants", "get_variant",
           "variants"]


class AdapterVariant:
    """The plain LoRA update (Hu et al. 2021): ``y = W x + b + s * B A dropout(x)``, ``s = alpha / r``.

    Subclass and override what differs; return an instance from a ``plyx_adapter_variants`` Component.

    Attributes:
        name: what ``LoraConfig.variant`` names.
        extra_parameters: names of the ``nn.ParameterDict`` attributes (keyed by adapter name) that
            ``init`` fills on the layer; they are saved, loaded, trained and deleted with ``A`` and ``B``.
    """

    name = "lora"
    extra_parameters: tuple[str, ...] = ()

    def scaling(self, r: int, alpha: float) -> float:
        """The factor on ``B A``."""
        return alpha / r

    def peft_flags(self) -> dict[str, Any]:
        """Fields of PEFT's ``adapter_config.json`` that select this variant (``save_peft``)."""
        return {"use_rslora": False, "use_dora": False}

    def init(self, layer: LoraLinear, name: str) -> None:
        """Create the variant's own parameters on ``layer`` for adapter ``name`` (``A``, ``B`` exist already)."""

    def lora_out(self, layer: LoraLinear, name: str, x: torch.Tensor) -> torch.Tensor:
        """``s * B A x`` without dropout, in ``x``'s dtype."""
        A, B = layer.lora_A[name], layer.lora_B[name]
        return B(A(x.to(A.weight.dtype))) * layer.scaling[name]

    def forward(self, layer: LoraLinear, name: str, x: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
        """The adapted output, given ``result = W x + b`` (the base layer's output).

        Args:
            layer: the adapted linear. name: the active adapter. x: its input ``[..., in]``.
            result: ``[..., out]``.

        Returns:
            ``[..., out]`` in ``result``'s dtype.
        """
        drop = layer.lora_dropout[name]
        return result + self.lora_out(layer, name, drop(x)).to(result.dtype)

    def delta_weight(self, layer: LoraLinear, name: str) -> torch.Tensor:
        """``s * B @ A``: ``[out, in]``, float32 at least (merges add it in full precision, then round once)."""
        A, B = layer.lora_A[name].weight, layer.lora_B[name].weight
        dtype = torch.promote_types(A.dtype, torch.float32)
        return (B.to(dtype) @ A.to(dtype)) * layer.scaling[name]  # (out, r) @ (r, in)

    @torch.no_grad()
    def merge(self, layer: LoraLinear, name: str) -> None:
        """Fold the adapter into ``layer.weight`` in place (so packed weight buffers stay packed)."""
        w = layer.weight
        w.copy_((w.to(torch.promote_types(w.dtype, torch.float32)) + self.delta_weight(layer, name)).to(w.dtype))

    @torch.no_grad()
    def unmerge(self, layer: LoraLinear, name: str) -> None:
        """Undo ``merge`` in place."""
        w = layer.weight
        w.copy_((w.to(torch.promote_types(w.dtype, torch.float32)) - self.delta_weight(layer, name)).to(w.dtype))


class LoraVariant(AdapterVariant):
    """LoRA: ``scaling = alpha / r``."""


class RsLoraVariant(AdapterVariant):
    """Rank-stabilised LoRA (Kalajdzievski 2023): ``scaling = alpha / sqrt(r)``, so the update's size
    does not shrink as the rank grows. PEFT: ``use_rslora=True``."""

    name = "rslora"

    def scaling(self, r: int, alpha: float) -> float:
        return alpha / math.sqrt(r)

    def peft_flags(self) -> dict[str, Any]:
        return {"use_rslora": True, "use_dora": False}


class DoraVariant(AdapterVariant):
    """Weight-decomposed LoRA (Liu et al. 2024): ``W' = m * (W + s B A) / ||W + s B A||_row``.

    ``m [out]`` (``lora_magnitude_vector``) starts at the row norms of ``W + s B A``. As in PEFT
    (and section 4.3 of the paper), the norm is detached from the graph: no gradient flows through
    it. The forward then needs no ``[out, in]`` product with ``x``::

        y = W x + b + (m / n - 1) * (W x) + (m / n) * s * B A x,    n = ||W + s (B A).detach()||_row.detach()

    With dropout in train mode ``W x`` is recomputed on the dropped input (PEFT does the same).
    """

    name = "dora"
    extra_parameters = ("lora_magnitude_vector",)

    def peft_flags(self) -> dict[str, Any]:
        return {"use_rslora": False, "use_dora": True}

    def weight_norm(self, layer: LoraLinear, name: str) -> torch.Tensor:
        """``||W + s B A||`` over each output row, no gradient: ``[out]`` float32 at least."""
        with torch.no_grad():
            w = layer.weight
            dtype = torch.promote_types(w.dtype, torch.float32)
            return torch.linalg.vector_norm(w.to(dtype) + self.delta_weight(layer, name), dim=1)

    def init(self, layer: LoraLinear, name: str) -> None:
        if not hasattr(layer, "lora_magnitude_vector"):
            layer.lora_magnitude_vector = nn.ParameterDict()
        layer.lora_magnitude_vector[name] = nn.Parameter(self.weight_norm(layer, name).to(layer.weight.dtype))

    def forward(self, layer: LoraLinear, name: str, x: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
        drop = layer.lora_dropout[name]
        m = layer.lora_magnitude_vector[name]
        scale = (m / self.weight_norm(layer, name).to(m.dtype)).to(result.dtype)  # (out,)
        if isinstance(drop, nn.Identity) or not layer.training:
            base = result if layer.bias is None else result - layer.bias.to(result.dtype)  # W x
        else:
            x = drop(x)
            base = F.linear(x, layer.weight).to(result.dtype)  # W dropout(x), as PEFT
        return result + (scale - 1) * base + scale * self.lora_out(layer, name, x).to(result.dtype)

    @torch.no_grad()
    def merge(self, layer: LoraLinear, name: str) -> None:
        w = layer.weight
        dtype = torch.promote_types(w.dtype, torch.float32)
        norm = self.weight_norm(layer, name)
        factor = layer.lora_magnitude_vector[name].to(dtype) / norm  # (out,)
        layer.merge_cache[name] = factor  # unmerge divides by the same factor
        w.copy_((factor[:, None] * (w.to(dtype) + self.delta_weight(layer, name))).to(w.dtype))

    @torch.no_grad()
    def unmerge(self, layer: LoraLinear, name: str) -> None:
        w = layer.weight
        dtype = torch.promote_types(w.dtype, torch.float32)
        factor = layer.merge_cache.pop(name).to(w.device)  # the model may have moved since the merge
        w.copy_((w.to(dtype) / factor[:, None] - self.delta_weight(layer, name)).to(w.dtype))


def builtin_variants() -> dict[str, AdapterVariant]:
    """The variants plyx-model ships (also what its plugin contributes)."""
    return {v.name: v for v in (LoraVariant(), RsLoraVariant(), DoraVariant())}


def variants() -> dict[str, AdapterVariant]:
    """Every variant by name: the ``plyx_adapter_variants`` components, plus the built-ins when plugin
    autoload is off (``PLYX_DISABLE_PLUGIN_AUTOLOAD`` skips plyx-model's own plugin too)."""
    from plyx.specs.plugins import components

    found: dict[str, AdapterVariant] = {}
    for name, comp in components("plyx_adapter_variants").items():
        variant = comp.factory()
        if not isinstance(variant, AdapterVariant):
            raise AdapterError(
                f"adapter variant {name!r} from {comp.source or 'a plugin'} built {type(variant).__name__}, "
                f"not a plyx.model.adapters.AdapterVariant; subclass AdapterVariant in the plugin"
            )
        found[name] = variant
    for name, variant in builtin_variants().items():
        found.setdefault(name, variant)
    return found


def get_variant(name: str) -> AdapterVariant:
    """The variant ``name``, or an error naming the known ones."""
    found = variants()
    if name not in found:
        raise AdapterError(
            f"adapter variant {name!r} not found. It is either misspelled or not installed; "
            f"use one of {', '.join(sorted(found))}, or install the plugin that provides it"
        )
    return found[name]
