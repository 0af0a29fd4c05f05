"""``rope_tables``: the cos/sin tables of RoPE at given positions, with Llama-3 and linear scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from plyx.kernel._errors import KernelInputError

__all__ = ["rope_tables", "inv_frequencies"]


def inv_frequencies(rotary_dim: int, theta: float, scaling: Any = None, *, device: Any = None) -> torch.Tensor:
    """``[R/2]`` float32 inverse frequencies ``theta^(-2i/R)``, scaled as Hugging Face does.

    ``scaling`` is a ``plyx.specs.RopeScaling`` (or anything with its fields):
    ``linear`` divides every frequency by ``factor``; ``llama3`` (Llama 3.1)
    divides low frequencies (wavelength > original/low_freq_factor) by ``factor``,
    keeps high ones (wavelength < original/high_freq_factor) and interpolates
    smoothly between them (transformers' ``_compute_llama3_parameters``).
    """
    if rotary_dim <= 0 or rotary_dim % 2:
        raise KernelInputError("rope_tables", "rotary_dim", f"must be a positive even number, got {rotary_dim}",
                               "use head_dim, or int(head_dim * partial_rotary) rounded down to even")
    if not theta > 0:
        raise KernelInputError("rope_tables", "theta", f"must be > 0, got {theta!r}", "Llama 3 uses 500000.0")
    inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim))
    if scaling is None:
        return inv
    kind = getattr(scaling, "kind", None)
    factor = float(scaling.factor)
    if kind == "linear":
        return inv / factor
    if kind != "llama3":
        raise KernelInputError("rope_tables", "scaling.kind", f"unknown kind {kind!r}", "use 'llama3' or 'linear'")
    low, high = float(scaling.low_freq_factor), float(scaling.high_freq_factor)
    original = float(scaling.original_max_seq_len)
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(
    positions: torch.Tensor,
    rotary_dim: int,
    theta: float = 10000.0,
    scaling: Any = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``position * inv_freq``, shaped like ``positions`` plus ``[R/2]``.

    Args:
        positions: integer position ids, ``[T]`` or ``[B, T]``.
        rotary_dim: R, the number of rotated dims per head (even, <= head_dim).
        theta: the RoPE base.
        scaling: a ``plyx.specs.RopeScaling`` or None.
        dtype: dtype of the returned tables (angles are computed in float32, as transformers does).
        device: defaults to the device of ``positions``.

    Returns:
        ``(cos, sin)``, each ``[T, R/2]`` or ``[B, T, R/2]``.

    Example::

        cos, sin = rope_tables(torch.arange(16), 64, 500000.0)
        q = registry().get("rope", q, cos, sin)(q, cos, sin)
    """
    if positions.dtype.is_floating_point or positions.dim() not in (1, 2):
        raise KernelInputError("rope_tables", "positions", f"expected integer ids [T] or [B, T], got {positions.dtype} "
                               f"of shape {list(positions.shape)}", "pass torch.arange(T) or the batch's position ids")
    device = positions.device if device is None else torch.device(device)
    inv = inv_frequencies(rotary_dim, theta, scaling, device=device)  # [R/2]
    angles = positions.to(device=device, dtype=torch.float32)[..., None] * inv  # [..., T, R/2]
    return angles.cos().to(dtype), angles.sin().to(dtype)
