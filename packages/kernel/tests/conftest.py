"""Shared fixtures of plyx-kernel's tests.

Without CUDA the Triton kernels run in Triton's interpreter on CPU tensors:
``TRITON_INTERPRET`` must be set before a kernel module is imported
(``triton.jit`` reads it at decoration), which happens lazily, after this file.
With CUDA the same tests run compiled on the GPU.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

#: triton is the `triton` (and `test`) extra; without it the Triton parity tests are not collected
HAVE_TRITON = importlib.util.find_spec("triton") is not None
if not HAVE_TRITON:
    collect_ignore = ["test_rmsnorm.py", "test_swiglu.py", "test_rope.py", "test_cross_entropy.py",
                      "test_linear_cross_entropy.py", "test_matmul.py", "test_rope_store_kv.py", "test_store_kv_quant.py", "test_rope_store_kv_quant.py", "test_rmsnorm_linear.py", "test_swiglu_linear.py",
                      "test_gemv.py", "test_grouped_gemm.py", "test_moe_permute.py", "test_moe_unpermute.py",
                      "test_compile_triton_boundary.py"]

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
#: where the Triton kernels run in these tests
TRITON_DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETING else "cpu"
GPU = TRITON_DEVICE == "cuda"

#: error allowed per dtype, relative to the float64 reference's largest magnitude (outputs, gradients).
#: float32: accumulation order only. bfloat16: inputs are the same bf16 values for both sides, so the
#: error is the kernel's own rounding (2^-9 per rounding of a stored value) plus float32 accumulation.
TOLERANCES = {torch.float32: (1e-4, 2e-4), torch.bfloat16: (2e-2, 4e-2)}


def rel_max_err(got: torch.Tensor, want: torch.Tensor, floor: float = 1e-12) -> float:
    """max |got - want| / max(max |want|, floor), in float64; NaN anywhere (a poisoned, unwritten element) gives inf.

    ``floor`` turns the measure absolute below a natural scale: a loss of 1e-4 nats is ``lse - z[t]``,
    a difference of two numbers of size |z|, so float32 can only promise its error relative to 1 nat.
    """
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if not torch.isfinite(got).all():
        return float("inf")
    return float((got - want).abs().max() / want.abs().max().clamp_min(floor))


@pytest.fixture(autouse=True)
def fresh_seed() -> int:
    """Fresh random inputs each run; the seed is in every assertion message."""
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    return seed


@pytest.fixture
def parity(fresh_seed: int) -> Callable[..., None]:
    """Compare ``fn`` (Triton, poisoned outputs) with ``ref`` in float64, outputs and gradients.

    ``args`` are made in the dtype under test on ``TRITON_DEVICE``; ``grad`` lists positional
    indices whose gradients are compared, through a random projection of the float outputs.
    """
    from plyx.kernel.triton_ops._common import poisoned

    def check(fn: Callable[..., Any], ref: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any] | None = None,
              grad: Sequence[int] = (), dtype: torch.dtype = torch.float32, label: str = "", floor: float = 1e-12,
              grad_floor: float = 1e-12, tolerances: tuple[float, float] | None = None) -> None:
        kwargs = kwargs or {}
        out_tol, grad_tol = tolerances or TOLERANCES[dtype]
        args = [a.detach().clone().requires_grad_(i in grad) if isinstance(a, torch.Tensor) else a
                for i, a in enumerate(args)]
        args64 = [a.detach().double().requires_grad_(i in grad) if isinstance(a, torch.Tensor) and a.is_floating_point()
                  else a for i, a in enumerate(args)]
        kw64 = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in kwargs.items()}
        with poisoned():
            got = fn(*args, **kwargs)
        want = ref(*args64, **kw64)
        got = list(got) if isinstance(got, tuple) else [got]
        want = list(want) if isinstance(want, tuple) else [want]
        where = f"{label} {dtype} seed={fresh_seed}"
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert g.shape == w.shape, f"{where}: output {i} shape {tuple(g.shape)} != {tuple(w.shape)}"
            if w.is_floating_point():
                assert g.dtype in (dtype, torch.float32), f"{where}: output {i} dtype {g.dtype}"
                err = rel_max_err(g, w, floor)
                assert err <= out_tol, f"{where}: output {i} error {err:.2e} > {out_tol:.0e}"
            else:
                assert torch.equal(g.cpu(), w.cpu()), f"{where}: integer output {i} differs"
        if not grad:
            return
        floats = [(g, w) for g, w in zip(got, want) if w.is_floating_point()]
        cot = [torch.randn(w.shape, dtype=torch.float64).to(w.device) for _, w in floats]
        with poisoned():
            grads = torch.autograd.grad([g for g, _ in floats], [args[i] for i in grad],
                                        [c.to(g.device, g.dtype) for (g, _), c in zip(floats, cot)])
        grads64 = torch.autograd.grad([w for _, w in floats], [args64[i] for i in grad], cot)
        for i, g, w in zip(grad, grads, grads64):
            assert g.shape == w.shape and g.dtype == args[i].dtype, f"{where}: grad {i} {g.shape} {g.dtype}"
            err = rel_max_err(g, w, grad_floor)
            assert err <= grad_tol, f"{where}: gradient of argument {i} error {err:.2e} > {grad_tol:.0e}"

    return check


def randn(*shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    return (torch.randn(*shape) * scale + shift).to(device=TRITON_DEVICE, dtype=dtype)


@pytest.fixture
def make() -> Callable[..., torch.Tensor]:
    """``make(*shape, dtype=, scale=, shift=)``: a random tensor on TRITON_DEVICE."""
    return randn
