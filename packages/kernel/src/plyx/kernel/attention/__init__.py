"""Attention kernels of plyx-kernel: ``attention`` and ``paged_attention``.

Implementations (all follow the contracts documented on ``attention_reference``,
``paged_attention_reference`` and ``paged_attention_quant_reference``: paged decode
attention over an int8 / float8_e4m3fn cache with per-token, per-head scales):

- ``reference``: plain torch, any device and dtype, float64 gradcheck-able (priority 0);
- ``sdpa``: torch's scaled_dot_product_attention (priority 10);
- ``triton``: FlashAttention-2 style forward and backward and a paged
  split-K decode kernel, CUDA only (priority 20), imported on first call;
- ``hybrid``: ``sdpa`` for plain causal calls, ``triton`` for packed documents,
  windows, masks and lse (CUDA, priority 5: chosen by name, by the training step).

``register(registry)`` adds them to a ``KernelRegistry``; the kernel plugin
calls it from its ``plyx_register_attention_backends`` hook. Selection query
sizes understood by the predicates: ``head_dim``.

The package itself is callable: ``plyx.kernel.attention(q, k, v, **options)``
dispatches through the default registry like ``plyx.kernel.rmsnorm`` does (a
function of that name could not live beside the subpackage: importing the
subpackage rebinds the attribute ``plyx.kernel.attention`` to the module).
"""

from __future__ import annotations

import sys
import types
from typing import Any

from plyx.kernel._registry import _tracing
from plyx.kernel.attention._hybrid import attention_hybrid
from plyx.kernel.attention._reference import (
    attention_reference,
    paged_attention_quant_reference,
    paged_attention_reference,
)
from plyx.kernel.attention._sdpa import attention_sdpa

__all__ = [
    "attention_hybrid",
    "attention_reference",
    "attention_sdpa",
    "attention_triton",
    "paged_attention_quant_reference",
    "paged_attention_quant_triton",
    "paged_attention_reference",
    "paged_attention_triton",
    "register",
]


def _load_flash() -> Any:
    from plyx.kernel.attention._flash import flash_attention

    return flash_attention


def _load_paged() -> Any:
    from plyx.kernel.attention._paged import paged_attention

    return paged_attention


def attention_triton(*args: Any, **kwargs: Any) -> Any:
    """The Triton flash attention (``attention`` contract); imports Triton on first call.

    Reached by Dynamo (``torch.compile`` tracing a call to it), it is the ``plyx::attention`` custom op
    instead: Dynamo never traces a Triton launch (``plyx.kernel._custom_ops.reached_under_compile``).
    """
    if _tracing():
        from plyx.kernel._custom_ops import reached_under_compile

        return reached_under_compile("attention", _load_flash, args, kwargs)
    return _load_flash()(*args, **kwargs)


def paged_attention_triton(*args: Any, **kwargs: Any) -> Any:
    """The Triton paged decode attention (``paged_attention`` contract); imports Triton on first call.

    Reached by Dynamo it runs eagerly behind ``torch.compiler.disable`` (no custom op: inference only).
    """
    if _tracing():
        from plyx.kernel._custom_ops import reached_under_compile

        return reached_under_compile("paged_attention", _load_paged, args, kwargs)
    return _load_paged()(*args, **kwargs)


def paged_attention_quant_triton(*args: Any, **kwargs: Any) -> Any:
    """The Triton paged decode attention over int8 / fp8 pools (``paged_attention_quant``); imports Triton on first call."""
    from plyx.kernel.attention._paged import paged_attention_quant

    return paged_attention_quant(*args, **kwargs)


def register(registry: Any) -> None:
    """Register every attention implementation on ``registry`` (a ``plyx.specs.KernelRegistry``)."""
    from plyx.kernel.attention._register import register_all

    register_all(registry)


class _DispatchingPackage(types.ModuleType):
    """``plyx.kernel.attention``: this package, and when called the ``attention`` kernel of the default registry."""

    def __call__(self, q: Any, k: Any, v: Any, **options: Any) -> Any:
        """``attention(q [B, T, H, Dh], k, v [B, S, KV, Dh], *, causal=True, ...)`` chosen for q's device, dtype and head_dim."""
        from plyx.kernel._default import registry

        return registry().get("attention", q, k, v)(q, k, v, **options)


sys.modules[__name__].__class__ = _DispatchingPackage
