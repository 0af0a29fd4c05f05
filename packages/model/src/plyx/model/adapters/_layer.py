"""``LoraLinear``: an ``nn.Linear`` carrying named adapters, one of them active.

It subclasses ``nn.Linear`` and keeps the base ``weight`` and ``bias`` Parameters themselves (same
objects, same names), so checkpoints of the base, optimizers over it, packed q/k/v buffers
(``plyx.attn.pack_linears_``) and anything holding the Parameters keep working. Adapter tensors
sit beside them under PEFT's names (``lora_A.<adapter>.weight``, ``lora_B.<adapter>.weight``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from plyx.model.adapters._config import LoraConfig
from plyx.model.adapters._variants import AdapterVariant
from torch import nn

__all__ = ["LoraLinear"]


class LoraLinear(nn.Linear):
    """A linear with adapters. Build with ``LoraLinear.wrap(linear)``; undo with ``unwrap()``.

    Attributes:
        lora_A, lora_B: ``nn.ModuleDict`` of ``nn.Linear`` ``[r, in]`` and ``[out, r]`` per adapter.
        lora_dropout: ``nn.ModuleDict`` of ``nn.Dropout`` / ``nn.Identity`` per adapter.
        scaling: the factor on ``B A`` per adapter. variants: the ``AdapterVariant`` per adapter.
        active: the adapter used by ``forward`` (None: none). merged: the adapter folded into ``weight``.
        disabled: True inside ``disable_adapters`` (the base output, adapters kept).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("build a LoraLinear with LoraLinear.wrap(linear) (it adopts the linear's Parameters)")

    @classmethod
    def wrap(cls, linear: nn.Linear) -> LoraLinear:
        """A ``LoraLinear`` holding ``linear``'s own ``weight`` and ``bias`` Parameters, with no adapter yet."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.train(linear.training)
        self.lora_A = nn.ModuleDict()
        self.lora_B = nn.ModuleDict()
        self.lora_dropout = nn.ModuleDict()
        self.scaling: dict[str, float] = {}
        self.variants: dict[str, AdapterVariant] = {}
        self.merge_cache: dict[str, torch.Tensor] = {}
        self.active: str | None = None
        self.merged: str | None = None
        self.disabled = False
        return self

    def unwrap(self) -> nn.Linear:
        """A plain ``nn.Linear`` holding this layer's ``weight`` and ``bias`` (merged or not, as they are now)."""
        linear = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(linear)
        linear.in_features, linear.out_features = self.in_features, self.out_features
        linear.weight, linear.bias = self.weight, self.bias
        linear.train(self.training)
        return linear

    # -- adapters -----------------------------------------------------------------------
    def add(self, name: str, config: LoraConfig, variant: AdapterVariant) -> None:
        """Create adapter ``name``: ``A`` Kaiming-uniform (PEFT's init), ``B`` zero unless
        ``config.init_lora_weights`` is False; then the variant's own parameters."""
        w = self.weight
        factory = {"device": w.device, "dtype": w.dtype if w.dtype.is_floating_point else torch.float32}
        A = nn.Linear(self.in_features, config.r, bias=False, **factory)
        B = nn.Linear(config.r, self.out_features, bias=False, **factory)
        with torch.no_grad():
            nn.init.kaiming_uniform_(A.weight, a=math.sqrt(5))
            if config.init_lora_weights:
                nn.init.zeros_(B.weight)
            # else: nn.Linear's own init of B (a non-zero update, as PEFT's init_lora_weights=False)
        self.lora_A[name], self.lora_B[name] = A, B
        self.lora_dropout[name] = nn.Dropout(config.dropout) if config.dropout > 0 else nn.Identity()
        self.scaling[name] = variant.scaling(config.r, config.alpha)
        self.variants[name] = variant
        variant.init(self, name)

    def remove(self, name: str) -> None:
        """Delete adapter ``name`` and its parameters."""
        variant = self.variants.pop(name)
        for attr in ("lora_A", "lora_B", "lora_dropout", *variant.extra_parameters):
            del getattr(self, attr)[name]
        del self.scaling[name]
        self.merge_cache.pop(name, None)
        if self.active == name:
            self.active = None

    def adapter_tensors(self, name: str) -> dict[str, nn.Parameter]:
        """Adapter ``name``'s parameters under PEFT's names within the module: ``lora_A.weight``,
        ``lora_B.weight``, and each of the variant's ``extra_parameters`` (``lora_magnitude_vector``)."""
        out = {"lora_A.weight": self.lora_A[name].weight, "lora_B.weight": self.lora_B[name].weight}
        for attr in self.variants[name].extra_parameters:
            out[attr] = getattr(self, attr)[name]
        return out

    @property
    def weight_is_effective(self) -> bool:
        """True when ``weight`` alone gives this layer's output (no adapter active, or it is merged):
        code that reads the weight directly (packed q/k/v GEMVs, fused decode kernels) may then do so."""
        return self.active is None or self.disabled or self.merged is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = F.linear(x, self.weight, self.bias)
        if self.weight_is_effective:
            return result
        name = self.active
        return self.variants[name].forward(self, name, x, result)  # type: ignore[index]

    def extra_repr(self) -> str:
        adapters = ", ".join(f"{n}({v.name}, r={self.lora_A[n].out_features})" for n, v in self.variants.items())
        return f"{super().extra_repr()}, adapters=[{adapters}], active={self.active}, merged={self.merged}"
