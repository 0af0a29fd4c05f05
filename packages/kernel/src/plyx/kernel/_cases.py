"""Conformance cases of the kernel names plyx-kernel introduces beyond plyx-specs' list (``rope_qk``).

A plugin that brings a kernel name gives it cases (``plyx.specs.testing.kernels.add_cases``); plyx-kernel
does so for its own additions when its plugin registers, so the conformance kit (``plyx kernels check``, the
registry's probe of third-party implementations) holds every implementation of those names to them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["add_kernel_cases"]


def _oracle_rope_qk(q: Any, k: Any, cos: Any, sin: Any, *, interleaved: bool = False) -> Any:
    """The contract in float64: each of q and k rotated pair by pair (``rope``'s definition)."""
    import torch

    def rotate(x: Any) -> Any:
        r = 2 * cos.shape[-1]
        c = (cos if cos.dim() == 3 else cos[None])[:, :, None, :]  # (B|1, T, 1, R/2)
        s = (sin if sin.dim() == 3 else sin[None])[:, :, None, :]
        xr = x[..., :r]
        if interleaved:
            a, b = xr[..., 0::2], xr[..., 1::2]
            out = torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)
        else:
            a, b = xr[..., : r // 2], xr[..., r // 2:]
            out = torch.cat((a * c - b * s, b * c + a * s), dim=-1)
        return torch.cat((out, x[..., r:]), dim=-1)

    return rotate(q), rotate(k)


def _qk(b: int, t: int, h: int, kv: int, dh: int, rotary: int, batched: bool, interleaved: bool) -> Any:
    def make(torch: Any, gen: Any, dt: Any, dev: str) -> Any:
        def rand(shape: Sequence[int]) -> Any:
            return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device=dev, dtype=dt)

        angles = torch.rand(*((b, t) if batched else (t,)), rotary // 2, generator=gen, dtype=torch.float64) * 6.283
        cos, sin = angles.cos().to(device=dev, dtype=dt), angles.sin().to(device=dev, dtype=dt)
        return [rand((b, t, h, dh)), rand((b, t, kv, dh)), cos, sin], {"interleaved": interleaved}, (0, 1)

    return make


def add_kernel_cases() -> None:
    """Give ``rope_qk`` its cases (once per process; a second call is a no-op)."""
    from plyx.specs.testing.kernels import KERNEL_CASES, KernelCase, add_cases

    if "rope_qk" in KERNEL_CASES.keys():
        return
    add_cases(
        "rope_qk",
        KernelCase("rope_qk GQA 4/2 [2, 5, *, 16]", _qk(2, 5, 4, 2, 16, 16, False, False), _oracle_rope_qk),
        KernelCase("rope_qk MQA 3/1 interleaved partial R=6 [2, 5, *, 10], per-batch tables",
                   _qk(2, 5, 3, 1, 10, 6, True, True), _oracle_rope_qk),
        KernelCase("rope_qk 2/2 [1, 6, *, 64]", _qk(1, 6, 2, 2, 64, 64, False, False), _oracle_rope_qk),
    )
