"""Shared fixtures of the attention tests.

Without CUDA the Triton kernels run in Triton's interpreter: TRITON_INTERPRET
must be set before the kernels' module is imported (``triton.jit`` reads it at
decoration), which happens lazily on the first call, after this conftest.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
#: where the Triton kernels of the small-shape tests run: the interpreter on CPU, else the GPU
TRITON_DEVICE = "cpu" if INTERPRETING or not torch.cuda.is_available() else "cuda"


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| in float64 (NaN anywhere gives NaN, which fails every bound)."""
    got, ref = got.detach().double(), ref.detach().double()
    return float((got - ref).norm() / ref.norm().clamp_min(1e-30))


def grad_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Like ``rel_err`` with the denominator floored at 0.1 per element (RMS): a gradient that is
    exactly 0 in float64 (a window of 1: softmax over one key) is judged by its absolute error."""
    got, ref = got.detach().double(), ref.detach().double()
    floor = 0.1 * ref.numel() ** 0.5
    return float((got - ref).norm() / max(float(ref.norm()), floor))


@pytest.fixture
def seed() -> int:
    # fresh random inputs for every test run; the seed is printed on failure by the assertion messages
    s = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(s)
    return s


@pytest.fixture
def poison(monkeypatch: pytest.MonkeyPatch):
    """Make every output and workspace of the Triton kernels start as NaN: each element must be written."""

    def _poisoned(shape, *, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.full(shape, float("nan"), device=like.device, dtype=dtype or like.dtype)

    def apply() -> None:
        from plyx.kernel.attention import _flash, _paged

        monkeypatch.setattr(_flash, "_empty", _poisoned)
        monkeypatch.setattr(_paged, "_empty", _poisoned)

    return apply
