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
        assert check_kernel(name, getattr(reference, name), dtypes=("float32", "bfloat16")).ok


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

    # eps=1e-5 on unit-variance rows moves the output by ~5e-6 relative: inside float32's tolerance,
    # so the kit checks a value that matters instead: smoothing in cross-entropy
    assert check_kernel("rmsnorm", no_eps).ok

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
