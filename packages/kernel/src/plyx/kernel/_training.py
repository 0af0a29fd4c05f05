"""Which attention and norm implementations a training step uses, eager and under ``torch.compile``.

A kernel that loses to the library on a device must not be the training step's default there. Measured on
an H100 (torch 2.11, 2026-11-24, the 1B Llama shape of ``plyx-train``'s ``bench/mfu.py``, 3 steps):

- attention: cuDNN SDPA 12.8 + 43.1 ms forward + backward, plyx's Triton flash kernel 14.4 + 53.2 ms;
- RMSNorm (+ residual) under ``torch.compile``: plyx's Triton kernels as opaque custom ops and the residual
  adds around them ~30 ms, Inductor's own fused reductions of the plain torch ops ~21 ms.

The choices (``TrainConfig.attention`` and ``TrainConfig.compiled_norms``):

=============  =====================================================================================
attention      rule
=============  =====================================================================================
``auto``       CUDA sm90+ (H100, H200): ``sdpa``'s routing; other GPUs: the registry's choice (the
               Triton kernel); CPU: torch SDPA (the registry's choice there), traced by Inductor under
               compile. An ``attention`` override already in force (``PLYX_KERNELS``, ``KernelConfig``)
               is kept.
``sdpa``       torch SDPA (``is_causal``, GQA by ``enable_gqa``: cuDNN/flash on CUDA) for unpacked
               batches; packed documents, windows and masks keep the Triton flash kernel on CUDA
               (SDPA would need a dense ``[T, S]`` mask). The registry's ``hybrid`` implementation.
``triton``     plyx's Triton flash kernel for every call (CUDA, bf16/fp16, head_dim 64/128).
=============  =====================================================================================

``compiled_norms``: ``kernel`` keeps the registry's RMSNorm kernel as the ``plyx::rmsnorm`` custom op under
compile; ``inductor`` hands Inductor the plain torch ops (float32 statistics, the reference's numerics) to
fuse with the residual adds and casts around them; ``auto`` is ``inductor``. Eager steps always run the
registry's kernel (plain ops there are several launches).

Under ``torch.compile`` SDPA is traced as ``aten`` SDPA (its own autograd with the saved log-sum-exp, as a
plain PyTorch loop gets), never through the ``plyx::attention`` custom op, which would recompute an
implementation without saved statistics in its backward; the Triton kernel's custom op saves its lse.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ATTENTION_CHOICES", "NORM_CHOICES", "TrainingKernels", "resolve_training_kernels", "training_kernels"]

ATTENTION_CHOICES = ("auto", "sdpa", "triton")
NORM_CHOICES = ("auto", "kernel", "inductor")
#: compute capability from which ``auto`` routes unpacked attention to SDPA (measured on sm90: H100)
SDPA_MIN_CC = (9, 0)


@dataclass(frozen=True)
class TrainingKernels:
    """A resolved choice.

    Attributes:
        attention: the registry override applied (``hybrid``, ``triton``, ``sdpa``) or None (the registry's own
            choice, or an override already in force).
        compiled_attention: under compile, ``sdpa`` (SDPA traced for plain causal calls, the custom op for the
            rest), ``sdpa-all`` (SDPA traced for every call: CPU) or ``op`` (the ``plyx::attention`` custom op).
        compiled_norms: ``inductor`` or ``kernel``.
        reason: one line for the run's log.
    """

    attention: str | None
    compiled_attention: str
    compiled_norms: str
    reason: str

    def describe(self, compiled: bool = True) -> str:
        """``kernels: attention = ...`` (and, ``compiled``, what the compiled graph traces) with the reason."""
        eager = {"hybrid": "torch SDPA for unpacked batches, Triton flash for packed documents/windows/masks",
                 "triton": "Triton flash for every call", "sdpa": "torch SDPA for every call",
                 None: "the kernel registry's choice"}[self.attention]
        if not compiled:
            return f"kernels: attention = {eager} ({self.reason})"
        traced = {"sdpa": "SDPA traced for unpacked batches, the plyx::attention op for the rest",
                  "sdpa-all": "SDPA traced for every call", "op": "the plyx::attention op"}[self.compiled_attention]
        norms = {"inductor": "torch ops fused by Inductor", "kernel": "the plyx::rmsnorm op"}[self.compiled_norms]
        return f"kernels: attention = {eager}; compiled: attention = {traced}, RMSNorm = {norms} ({self.reason})"


def resolve_training_kernels(attention: str = "auto", norms: str = "auto", *,
                             device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16) -> TrainingKernels:
    """The choice for a step on ``device`` whose attention inputs have ``dtype``.

    Args:
        attention: ``auto`` | ``sdpa`` | ``triton``; norms: ``auto`` | ``kernel`` | ``inductor``.
        device: the training device; dtype: q/k/v's dtype (bf16 under bf16 autocast).

    Returns:
        A ``TrainingKernels``.

    Raises:
        ValueError: an unknown choice, or ``triton`` where the Triton kernel cannot run (CPU, float32, a GPU
        older than sm80), with the fix.
    """
    if attention not in ATTENTION_CHOICES:
        raise ValueError(f"attention = {attention!r}: choose one of {', '.join(ATTENTION_CHOICES)}")
    if norms not in NORM_CHOICES:
        raise ValueError(f"compiled_norms = {norms!r}: choose one of {', '.join(NORM_CHOICES)}")
    device = torch.device(device)
    compiled_norms = "kernel" if norms == "kernel" else "inductor"
    cuda = device.type == "cuda"
    triton_ok = cuda and dtype in (torch.bfloat16, torch.float16) and _capability(device) >= (8, 0)
    if attention == "triton":
        if not triton_ok:
            where = f"{device.type}, {str(dtype).removeprefix('torch.')}"
            raise ValueError(f"attention = 'triton' needs a CUDA GPU (sm80+) and bf16/fp16 attention inputs, not "
                             f"{where}: use attention = 'auto' (or 'sdpa'), or train on CUDA with "
                             f"precision = 'bf16-autocast'")
        return TrainingKernels("triton", "op", compiled_norms, "forced: attention = 'triton'")
    forced = _override_in_force()
    if attention == "auto" and forced is not None:
        # traced SDPA where the override's implementation would route to SDPA anyway
        compiled = {"sdpa": "sdpa-all", "hybrid": "sdpa"}.get(forced, "op")
        return TrainingKernels(None, compiled, compiled_norms, f"auto: keeps the override attention={forced}")
    if not cuda:
        # no Triton kernel: SDPA everywhere, traced (a custom op would recompute SDPA in its backward)
        override = "sdpa" if attention == "sdpa" else None
        return TrainingKernels(override, "sdpa-all", compiled_norms, f"{attention}: {device.type} has no Triton kernel")
    if not triton_ok:  # float32 on CUDA (the Triton kernel refuses it), or an old GPU: SDPA for every call
        override = "sdpa" if attention == "sdpa" else None
        return TrainingKernels(override, "sdpa-all", compiled_norms,
                               f"{attention}: the Triton kernel does not run {str(dtype).removeprefix('torch.')} here")
    if attention == "sdpa":
        return TrainingKernels("hybrid", "sdpa", compiled_norms, "forced: attention = 'sdpa'")
    cc = _capability(device)
    if cc >= SDPA_MIN_CC:
        return TrainingKernels("hybrid", "sdpa", compiled_norms,
                               f"auto: sm{cc[0]}{cc[1]}, cuDNN SDPA beats the Triton kernel on sm90 (H100 profile, "
                               f"2026-11-24)")
    return TrainingKernels(None, "op", compiled_norms, f"auto: sm{cc[0]}{cc[1]}, the registry's choice (no measurement "
                                                       f"of SDPA against the Triton kernel below sm90)")


@contextlib.contextmanager
def training_kernels(attention: str = "auto", norms: str = "auto", *, device: torch.device | str = "cpu",
                     dtype: torch.dtype = torch.bfloat16) -> Iterator[TrainingKernels]:
    """Apply a ``resolve_training_kernels`` choice inside the block (the registry override and the compile path).

    The registry override is scoped like ``registry().override(...)`` (this thread's context); the compile path's
    choice is process-wide while the block runs (``torch.compile`` guards on it: a change recompiles).

    Yields:
        The ``TrainingKernels`` in force.
    """
    from plyx.kernel import _custom_ops
    from plyx.kernel._default import registry

    chosen = resolve_training_kernels(attention, norms, device=device, dtype=dtype)
    previous = dict(_custom_ops.COMPILE_CHOICES)
    scope = registry().override(attention=chosen.attention) if chosen.attention else contextlib.nullcontext()
    try:
        with scope:
            _custom_ops.COMPILE_CHOICES.update(attention=chosen.compiled_attention, rmsnorm=chosen.compiled_norms)
            yield chosen
    finally:
        _custom_ops.COMPILE_CHOICES.clear()
        _custom_ops.COMPILE_CHOICES.update(previous)


def _capability(device: torch.device) -> tuple[int, int]:
    if device.type != "cuda" or not torch.cuda.is_available():
        return (0, 0)
    return tuple(torch.cuda.get_device_capability(device))  # type: ignore[return-value]


def _override_in_force() -> Any:
    from plyx.kernel._default import registry

    got = registry().overrides().get("attention")
    return None if got is None else got[0]
