"""Dynamo never traces a Triton launch, however it reaches a Triton implementation.

Model code asks for ``traceable(name)`` under ``torch.compile``; these tests take the other roads to a Triton
kernel that a compiled training step can take: the registry's callable fetched before tracing began (a cached
or bound kernel) and called inside the compiled region. Traced, that call wrapped the Triton launch in
``triton_kernel_wrapper_mutation`` on a GPU (whose mutation analysis fails on inline PTX: the H100 run's
``tt.elementwise_inline_asm``); in Triton's interpreter on CPU Dynamo traced into the interpreter and failed.
Now a kernel with a custom op becomes that op, any other kernel runs eagerly behind a graph break.

Without CUDA the Triton implementations run in the interpreter (``TRITON_INTERPRET=1``, set by conftest), on
a private registry where they accept CPU tensors.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from plyx.kernel._default import populate
from plyx.kernel._registry import Registry
from plyx.kernel.attention import attention_triton
from plyx.kernel.triton_ops._registration import _lazy
from plyx.specs.kernels import Capability, KernelImpl

from .conftest import TRITON_DEVICE

#: every kernel the training forward and backward reach, Triton on the test device
TRAINING = ("rmsnorm", "swiglu", "rope", "rope_qk", "cross_entropy", "linear_cross_entropy")


def _registry() -> Registry:
    reg = populate(Registry())
    for name in (*TRAINING, "matmul"):
        reg.register(KernelImpl(name, "triton-anywhere", _lazy(name, name), capability=Capability(), priority=100))
    reg.register(KernelImpl("attention", "triton-anywhere", attention_triton,
                            capability=Capability(dtypes={"bfloat16", "float16"}), priority=100))
    return reg


def _graphs(fn: Any, *args: Any) -> tuple[Any, set[str]]:
    """Compile ``fn`` with a backend that records every FX graph Dynamo hands it; (result, call targets)."""
    seen: set[str] = set()

    def backend(gm: torch.fx.GraphModule, example: Any) -> Any:
        seen.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    return torch.compile(fn, backend=backend)(*args), seen


def _no_triton_launch(targets: set[str]) -> None:
    assert not any("triton_kernel_wrapper" in t for t in targets), sorted(targets)


def test_a_kernel_fetched_before_tracing_becomes_its_custom_op() -> None:
    reg = _registry()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 24, generator=g).to(TRITON_DEVICE).requires_grad_()
    w = (1 + 0.1 * torch.randn(24, generator=g)).to(TRITON_DEVICE).requires_grad_()
    norm = reg.get("rmsnorm", x, w)  # the Triton implementation, bound outside any traced region
    swiglu = reg.get("swiglu", x, x)
    assert norm.__name__ == "rmsnorm" and "triton" in norm.__doc__

    def block(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        y, h = norm(a * 2, b, eps=1e-5, residual=a)
        return swiglu(y, h).sum()

    want = block(x, w)
    gw = torch.autograd.grad(want, (x, w))
    torch._dynamo.reset()
    explain = torch._dynamo.explain(block)(x, w)
    assert explain.graph_break_count == 0, explain.break_reasons
    got, targets = _graphs(block, x, w)
    _no_triton_launch(targets)
    assert {"plyx.rmsnorm_residual.default", "plyx.swiglu.default"} <= targets, sorted(targets)
    go = torch.autograd.grad(got, (x, w))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(go, gw, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_a_kernel_without_custom_op_runs_eagerly_behind_a_graph_break() -> None:
    reg = _registry()
    a = torch.randn(8, 16).to(TRITON_DEVICE)
    b = torch.randn(16, 8).to(TRITON_DEVICE)
    mm = reg.get("matmul", a, b)

    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return mm(x + 1, y) * 2

    got, targets = _graphs(f, a, b)
    _no_triton_launch(targets)
    assert not any("plyx" in t for t in targets)
    torch.testing.assert_close(got, ((a + 1) @ b) * 2, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernel", ["attention", "rope", "rope_qk", "cross_entropy", "linear_cross_entropy"])
def test_every_training_kernel_reached_directly_is_opaque(kernel: str) -> None:
    reg = _registry()
    g = torch.Generator().manual_seed(1)

    def r(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(TRITON_DEVICE, dtype)

    if kernel == "attention":
        q, k, v = r(1, 4, 2, 64, dtype=torch.bfloat16), r(1, 4, 1, 64, dtype=torch.bfloat16), r(1, 4, 1, 64, dtype=torch.bfloat16)
        args: tuple[Any, ...] = (q, k, v)
        kwargs: dict[str, Any] = {"causal": True}
    elif kernel == "rope":
        from plyx.kernel import rope_tables

        cos, sin = rope_tables(torch.arange(4), 8, 10000.0)
        args, kwargs = (r(2, 4, 3, 8), cos.to(TRITON_DEVICE), sin.to(TRITON_DEVICE)), {}
    elif kernel == "rope_qk":
        from plyx.kernel import rope_tables

        cos, sin = rope_tables(torch.arange(4), 8, 10000.0)
        args, kwargs = (r(2, 4, 3, 8), r(2, 4, 1, 8), cos.to(TRITON_DEVICE), sin.to(TRITON_DEVICE)), {}
    elif kernel == "cross_entropy":
        args, kwargs = (r(6, 11), torch.randint(0, 11, (6,), generator=g).to(TRITON_DEVICE)), {}
    else:
        args, kwargs = (r(6, 8), r(11, 8), torch.randint(0, 11, (6,), generator=g).to(TRITON_DEVICE)), {}
    fn = reg.get(kernel, *args)
    want = fn(*args, **kwargs)
    got, targets = _graphs(lambda *a: fn(*a, **kwargs), *args)
    _no_triton_launch(targets)
    assert f"plyx.{kernel}.default" in targets, sorted(targets)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
