"""The conformance kit catches what it must: wrong values, wrong gradients, unwritten elements, wrong shapes."""

from __future__ import annotations

import pytest
import torch
from plyx.kernel import reference
from plyx.specs.testing.kernels import KERNEL_CASES, assert_kernel_conforms, check_kernel


class _WrongBackward(torch.autograd.Function):
    """swiglu with a correct forward and a backward that forgets the sigmoid's derivative term."""

    @staticmethod
    def forward(ctx, g, u):
        ctx.save_for_backward(g, u)
        return torch.nn.functional.silu(g) * u

    @staticmethod
    def backward(ctx, dy):
        g, u = ctx.saved_tensors
        s = torch.sigmoid(g)
        return dy * u * s, dy * g * s


def test_reference_implementations_pass():
    for name in KERNEL_CASES.keys():
        report = check_kernel(name, getattr(reference, name), dtypes=("float32", "bfloat16", "float16"))
        assert report.ok, report.failures
        assert {r.direction for r in report.results} == {"forward", "backward"}


def test_error_model_tolerances():
    from plyx.specs.testing.kernels import tolerance

    # bfloat16: two roundings of 2^-8 plus the float32 sum term; a 1% bias is outside it
    assert 7.8e-3 < tolerance("bfloat16", 64) < 1e-2
    assert tolerance("float32", 1100) < 2e-5 and tolerance("float16", 1) < 1e-3
    assert tolerance("bfloat16", 64, grad=True) > tolerance("bfloat16", 64)


def test_a_one_percent_bias_in_bfloat16_is_caught():
    def biased(g, u):
        return (reference.swiglu(g, u).float() * 1.01).to(g.dtype)

    report = check_kernel("swiglu", biased, dtypes=("bfloat16",), grad=False)
    assert not report.ok and all("off by" in f for f in report.failures), report.failures


def test_an_output_wider_than_declared_is_refused():
    def widened(x, w, *, eps=1e-6, residual=None):
        r = None if residual is None else residual.double()
        return reference.rmsnorm(x.double(), w.double(), eps=eps, residual=r)  # float64 for bfloat16 inputs

    report = check_kernel("rmsnorm", widened, dtypes=("bfloat16",), grad=False)
    assert report.failures and all("has dtype torch.float64, the contract says torch.bfloat16" in f
                                   for f in report.failures)


def test_a_kernel_wrong_only_on_the_residual_path_fails_a_full_check():
    def no_residual_add(x, w, *, eps=1e-6, residual=None):
        y = reference.rmsnorm(x, w, eps=eps)
        return y if residual is None else (y, x + residual)  # forgot to normalise x + residual

    assert check_kernel("rmsnorm", no_residual_add, quick=True).ok  # the first case has no residual
    report = check_kernel("rmsnorm", no_residual_add)
    assert not report.ok and all("residual" in f for f in report.failures)


def test_cases_of_plyx_names_cannot_be_replaced_new_names_can_be_added():
    from plyx.specs.testing.kernels import add_cases

    with pytest.raises(KeyError, match="cannot be replaced"):
        KERNEL_CASES["swiglu"] = KERNEL_CASES["matmul"]
    with pytest.raises(KeyError, match="already has conformance cases"):
        add_cases("rmsnorm", *KERNEL_CASES["rmsnorm"])


def test_wrong_gradient_is_reported():
    report = check_kernel("swiglu", lambda g, u: _WrongBackward.apply(g, u))
    assert not report.ok
    assert all("gradient of argument 0" in f for f in report.failures), report.failures


def test_forward_only_check_skips_gradients():
    assert check_kernel("swiglu", lambda g, u: _WrongBackward.apply(g, u), grad=False).ok


def test_unwritten_element_is_reported():
    def leaky(x, w, **kw):
        y = reference.rmsnorm(x, w, **kw)
        y0 = y[0] if isinstance(y, tuple) else y
        y0 = y0.clone()
        y0.view(-1)[-1] = float("nan")  # the element a kernel forgot to write
        return (y0, y[1]) if isinstance(y, tuple) else y0

    report = check_kernel("rmsnorm", leaky, grad=False)
    assert report.failures and all("NaN" in f for f in report.failures)


def test_missing_eps_is_caught_by_value():
    def no_eps(x, w, *, eps=1e-6, residual=None):
        return reference.rmsnorm(x, w, eps=0.0, residual=residual)

    # eps=1e-5 on unit-variance rows moves the output by ~5e-6 relative: above float32's error model
    # (2 u + 8 sqrt(K) u ~ 1e-5 at most for K=130, ~4e-6 at K=37), so even a missing eps is caught
    report = check_kernel("rmsnorm", no_eps, grad=False)
    assert any("rmsnorm [4, 37] float32" in f and "output 0" in f for f in report.failures), report.failures

    def no_smoothing(z, t, *, label_smoothing=0.0, **kw):
        return reference.cross_entropy(z, t, **kw)

    report = check_kernel("cross_entropy", no_smoothing)
    assert any("smoothing" in f and "output 0" in f for f in report.failures), report.failures


def test_wrong_shape_and_raising_kernels_are_reported():
    assert "shape" in check_kernel("matmul", lambda a, b: (a @ b)[..., :-1]).failures[0]
    failure = check_kernel("matmul", lambda a, b: 1 / 0).failures[0]
    assert "raised ZeroDivisionError" in failure


def test_assert_form_lists_failures_and_unknown_names_are_explained():
    with pytest.raises(AssertionError, match="swiglu fails conformance"):
        assert_kernel_conforms("swiglu", lambda g, u: _WrongBackward.apply(g, u))
    with pytest.raises(KeyError, match="no conformance cases for kernel 'frobnicate'"):
        check_kernel("frobnicate", lambda x: x)
