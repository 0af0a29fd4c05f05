"""``swiglu_linear``: the reference and the Triton kernel against a float64 oracle written from the definition."""

from __future__ import annotations

import math

import plyx.kernel as K
import pytest
import torch
from plyx.kernel import KernelInputError, reference, registry

from .conftest import INTERPRETING, TOLERANCES, TRITON_DEVICE, rel_max_err


def _oracle(gate_up, weight, bias):
    """float64 ``silu(gate) * up`` (rounded to the input dtype, as the swiglu kernel's output is) times weight^T."""
    f = gate_up.shape[-1] // 2
    g, u = gate_up[..., :f].double(), gate_up[..., f:].double()
    a = (g / (1.0 + torch.exp(-g)) * u).to(gate_up.dtype).double().cpu()  # [..., F]
    y = a @ weight.double().cpu().T  # [..., N]
    return y if bias is None else y + bias.double().cpu()


def _inputs(lead, f, n, dtype, bias, device=TRITON_DEVICE):
    gu = (2.0 * torch.randn(*lead, 2 * f)).to(device, dtype)
    w = (torch.randn(n, f) / math.sqrt(f)).to(device, dtype)
    b = torch.randn(n).to(device, dtype) if bias else None
    return gu, w, b


# (leading dims, F, N, bias): F of 70 and 3000 are not multiples of any block; N of 13 not of BLOCK_N
CASES = [((1, 1), 64, 24, False), ((2,), 70, 13, True), ((1, 2), 40, 16, False), ((1, 1), 3000, 10, True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_reference_matches_the_oracle(fresh_seed, case, dtype):
    lead, f, n, bias = case
    gu, w, b = _inputs(lead, f, n, dtype, bias, device="cpu")
    y = reference.swiglu_linear(gu, w, bias=b)
    assert y.shape == (*lead, n) and y.dtype == dtype
    tol = TOLERANCES[dtype][0]
    assert (err := rel_max_err(y, _oracle(gu, w, b), floor=1.0)) <= tol, f"seed={fresh_seed}: {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("blocks", [None, (4, 32, 4, 2)], ids=["default", "small-blocks"])
def test_triton_matches_the_oracle(fresh_seed, case, dtype, blocks):
    from plyx.kernel.triton_ops._common import poisoned
    from plyx.kernel.triton_ops.swiglu_linear import swiglu_linear

    lead, f, n, bias = case
    gu, w, b = _inputs(lead, f, n, dtype, bias)
    before = gu.clone()
    with poisoned():  # an output element the kernel never writes stays NaN and fails the check
        y = swiglu_linear(gu, w, bias=b, blocks=blocks)
    assert y.shape == (*lead, n) and y.dtype == dtype
    assert torch.equal(gu, before)
    # the interpreter truncates bf16 casts where a GPU rounds to nearest: twice the tolerance there
    tol = TOLERANCES[dtype][0] * (2 if INTERPRETING and dtype == torch.bfloat16 else 1)
    assert (err := rel_max_err(y, _oracle(gu, w, b), floor=1.0)) <= tol, f"seed={fresh_seed}: {err:.2e} > {tol:.0e}"


def test_triton_takes_two_rows_and_the_registry_sends_more_to_the_reference():
    from plyx.kernel.triton_ops.swiglu_linear import swiglu_linear

    gu, w, _ = _inputs((3,), 16, 8, torch.float32, False)
    with pytest.raises(ValueError, match="at most 2 rows, got 3"):
        swiglu_linear(gu, w)
    impls = {i.impl: i for i in registry().implementations("swiglu_linear")}
    assert impls["triton"].capability.shape_limits == {"rows": (1, 2)} and not impls["triton"].capability.backward
    cpu_gu, cpu_w, _ = _inputs((3,), 16, 8, torch.float32, False, device="cpu")
    assert registry().get("swiglu_linear", cpu_gu, cpu_w, rows=3, hidden=16) is reference.swiglu_linear
    assert rel_max_err(K.swiglu_linear(cpu_gu, cpu_w), _oracle(cpu_gu, cpu_w, None), floor=1.0) <= 1e-5


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_bad_inputs_name_the_argument(impl):
    if impl == "triton":
        from plyx.kernel.triton_ops.swiglu_linear import swiglu_linear as fn
    else:
        fn = reference.swiglu_linear
    gu, w, b = _inputs((1,), 16, 8, torch.float32, True)
    with pytest.raises(KernelInputError, match=r"`gate_up`.*2F"):
        fn(gu[..., :31], w)
    with pytest.raises(KernelInputError, match=r"`weight`.*F=16"):
        fn(gu, w[:, :15])
    with pytest.raises(KernelInputError, match=r"`bias`.*N=8"):
        fn(gu, w, bias=b[:7])
    with pytest.raises(KernelInputError) as err:
        fn(gu, w.clone().requires_grad_())
    assert err.value.argument == "weight" and "no gradient" in str(err.value)
    with torch.no_grad():  # outside grad mode a tensor that requires grad is fine
        fn(gu, w.clone().requires_grad_())
