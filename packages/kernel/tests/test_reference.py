"""The references: finite-difference gradchecks in float64, and the conformance kit on every implementation."""

from __future__ import annotations

import pytest
import torch
from plyx.kernel import Registry, reference, rope_tables
from plyx.kernel._default import populate
from plyx.specs.testing.kernels import check_registry

from .conftest import GPU, HAVE_TRITON, INTERPRETING, TRITON_DEVICE

F64 = {"dtype": torch.float64}


def _rand(*shape, grad=True):
    return torch.randn(*shape, **F64).requires_grad_(grad)


def _targets(n, v):
    t = torch.randint(0, v, (n,))
    t[0] = -100
    return t


GRADCHECKS = {
    "matmul": lambda: (reference.matmul, (_rand(2, 3, 5), _rand(5, 4)), {}),
    "rmsnorm": lambda: (reference.rmsnorm, (_rand(3, 7), _rand(7)), {"eps": 1e-5}),
    "rmsnorm residual": lambda: (reference.rmsnorm, (_rand(3, 7), _rand(7)), {"eps": 1e-5, "residual": _rand(3, 7)}),
    "swiglu": lambda: (reference.swiglu, (_rand(4, 6), _rand(4, 6)), {}),
    "rope": lambda: (reference.rope, (_rand(2, 3, 2, 8), *rope_tables(torch.arange(3), 6, 100.0, dtype=torch.float64)), {}),
    "rope full rotary": lambda: (reference.rope, (_rand(2, 3, 2, 8), *rope_tables(torch.arange(3), 8, 100.0,
                                                                             dtype=torch.float64)), {}),
    "rope_qk GQA": lambda: (reference.rope_qk, (_rand(2, 3, 4, 8), _rand(2, 3, 2, 8),
                                               *rope_tables(torch.arange(3), 8, 100.0, dtype=torch.float64)), {}),
    "rope interleaved": lambda: (reference.rope, (_rand(2, 3, 2, 8), *rope_tables(torch.arange(3), 8, 100.0, dtype=torch.float64)),
                                 {"interleaved": True}),
    "cross_entropy": lambda: (reference.cross_entropy, (_rand(5, 9), _targets(5, 9)),
                              {"label_smoothing": 0.1, "z_loss": 1e-2}),
    "cross_entropy none": lambda: (reference.cross_entropy, (_rand(5, 9), _targets(5, 9)), {"reduction": "none"}),
    "linear_cross_entropy": lambda: (reference.linear_cross_entropy, (_rand(5, 4), _rand(9, 4), _targets(5, 9)),
                                     {"bias": _rand(9), "label_smoothing": 0.1, "z_loss": 1e-2, "chunk_size": 2}),
    "moe_permute": lambda: (reference.moe_permute, (_rand(5, 3), torch.tensor([[0, 2], [1, 0], [2, 1], [2, 0], [1, 2]])),
                            {"num_experts": 3}),
    "moe_unpermute": lambda: (reference.moe_unpermute, (_rand(8, 3), torch.randperm(8).view(4, 2), _rand(4, 2)), {}),
    "grouped_gemm": lambda: (reference.grouped_gemm, (_rand(6, 4), _rand(3, 5, 4), torch.tensor([0, 2, 2, 6])), {}),
    "linear_cross_entropy none": lambda: (reference.linear_cross_entropy, (_rand(5, 4), _rand(9, 4), _targets(5, 9)),
                                          {"reduction": "none", "chunk_size": 3}),
}


@pytest.mark.parametrize("case", sorted(GRADCHECKS))
def test_reference_passes_float64_gradcheck(case):
    fn, args, kwargs = GRADCHECKS[case]()
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.requires_grad]

    def call(*inputs):
        it = iter(inputs)
        a = [next(it) if isinstance(x, torch.Tensor) and x.requires_grad else x for x in args]
        kw = {k: next(it) if isinstance(v, torch.Tensor) and v.requires_grad else v for k, v in kwargs.items()}
        return fn(*a, **kw)

    assert torch.autograd.gradcheck(call, tuple(tensors), eps=1e-6, atol=1e-5)


def _builtins() -> Registry:
    from plyx.kernel import _plugin

    reg = Registry(verify=False)
    _plugin.plyx_register_kernels(registry=reg)
    return reg


def test_every_builtin_conforms_on_cpu():
    """The kit's oracles (in plyx-specs) agree with every built-in; Triton ones through the interpreter."""
    triton_too = INTERPRETING and HAVE_TRITON
    reports = check_registry(_builtins(), device="cpu", dtypes=("float32", "bfloat16"), ignore_predicates=triton_too)
    assert {r.name for r in reports} == {"matmul", "rmsnorm", "swiglu", "rope", "rope_qk", "cross_entropy",
                                         "linear_cross_entropy",
                                         "moe_permute", "moe_unpermute", "grouped_gemm"}
    assert all(r.checked >= 4 for r in reports)
    assert [f for r in reports for f in r.failures] == []
    assert {r.impl for r in reports} == ({"reference", "triton"} if triton_too else {"reference"})


@pytest.mark.skipif(not GPU, reason="needs CUDA")
def test_every_builtin_conforms_on_cuda():
    reports = check_registry(_builtins(), device="cuda", dtypes=("float32", "bfloat16"))
    assert {r.impl for r in reports} == {"reference", "triton"}
    assert [f for r in reports for f in r.failures] == []


def test_default_registry_is_populated_by_the_plugin_hooks():
    reg = populate(Registry(verify=False))
    for name in ("matmul", "rmsnorm", "swiglu", "rope", "cross_entropy", "linear_cross_entropy"):
        impls = {i.impl: i for i in reg.implementations(name)}
        assert {"reference", "triton"} <= set(impls)
        assert impls["triton"].source.startswith("plyx-kernel ")
        assert impls["triton"].capability.devices == frozenset({"cuda"})
    assert TRITON_DEVICE in ("cpu", "cuda")
