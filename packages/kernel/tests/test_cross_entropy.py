"""Triton cross-entropy (ignore_index, smoothing, z-loss, reductions, argmax) against the float64 reference."""

from __future__ import annotations

import pytest
import torch
from plyx.kernel import KernelInputError
from plyx.kernel.reference import cross_entropy as reference
from plyx.kernel.triton_ops.cross_entropy import cross_entropy

from .conftest import GPU, TRITON_DEVICE

# (N, V): the interpreter's vocabulary block is 256 columns, so 257 and 600 straddle it
SHAPES = [(1, 2), (7, 67), (5, 257), (3, 600)]
if GPU:
    SHAPES += [(64, 32000), (9, 128256), (4, 16385)]

OPTIONS = [
    {},
    {"label_smoothing": 0.1, "z_loss": 1e-3},
    {"reduction": "sum", "return_argmax": True},
    {"reduction": "none", "label_smoothing": 0.05},
]


def _targets(n: int, v: int, ignored: float = 0.25) -> torch.Tensor:
    t = torch.randint(0, v, (n,))
    t[torch.rand(n) < ignored] = -100
    return t.to(TRITON_DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_matches_reference(parity, make, shape, dtype, options):
    n, v = shape
    t = _targets(n, v)
    z = make(n, v, dtype=dtype, scale=4.0)
    # losses are judged relative to max(|loss|, 1 nat) and gradients relative to max(|grad|, 1/N): a
    # confident row's p - 1 is a cancellation float32 only resolves to ~1e-7 absolute (see rel_max_err)
    parity(lambda z: cross_entropy(z, t, **options), lambda z: reference(z, t, **options), [z], grad=(0,),
           dtype=dtype, label=f"cross_entropy {shape} {options}", floor=1.0, grad_floor=1.0 / n)


def test_all_rows_ignored_gives_zero_loss_and_gradient(make):
    z = make(4, 50).requires_grad_(True)
    loss = cross_entropy(z, torch.full((4,), -100, device=TRITON_DEVICE))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(z.grad, torch.zeros_like(z))


def test_argmax_matches_torch_on_ties_and_blocks(make):
    z = make(3, 700)
    z[0, 5] = z[0, 400] = 1e4  # a tie across blocks: the first index wins, as torch.argmax
    z[1, 699] = 1e4  # the last column of the last, partial block
    _, argmax = cross_entropy(z, torch.zeros(3, dtype=torch.long, device=TRITON_DEVICE), return_argmax=True)
    assert argmax.dtype == torch.int64 and argmax.tolist() == z.argmax(-1).tolist()
    assert argmax[:2].tolist() == [5, 699]


def test_bad_inputs_name_kernel_and_argument():
    z = torch.randn(4, 10, device=TRITON_DEVICE)
    t = torch.zeros(4, dtype=torch.long, device=TRITON_DEVICE)
    with pytest.raises(KernelInputError, match=r"cross_entropy:triton.*`targets`.*\[4\]"):
        cross_entropy(z, t[:3])
    with pytest.raises(KernelInputError, match=r"`targets`.*int64.*\.long\(\)"):
        cross_entropy(z, t.float())
    with pytest.raises(KernelInputError, match=r"`logits`.*\[N, V\]"):
        cross_entropy(z[None], t)
    with pytest.raises(KernelInputError, match=r"`reduction`.*mean, sum, none"):
        cross_entropy(z, t, reduction="avg")
    with pytest.raises(KernelInputError, match=r"`label_smoothing`"):
        cross_entropy(z, t, label_smoothing=1.5)
    with pytest.raises(KernelInputError, match=r"reference.*`targets`.*id 10 outside \[0, 10\)"):
        reference(z, torch.full((4,), 10, device=TRITON_DEVICE))


def test_no_grad_forward_computes_no_gradient_buffer(make, monkeypatch):
    """Under torch.no_grad() the kernel runs its one-pass form (no [N, V] gradient is allocated)."""
    from plyx.kernel.triton_ops import cross_entropy as module

    seen = []
    real = module.ce_rows
    monkeypatch.setattr(module, "ce_rows", lambda *a, **k: seen.append(k["dz"]) or real(*a, **k))
    z = make(5, 70).requires_grad_(True)
    t = torch.randint(0, 70, (5,), device=TRITON_DEVICE)
    with torch.no_grad():
        a = cross_entropy(z, t)
    b = cross_entropy(z, t)
    assert seen[0] is None and seen[1] is not None
    assert not a.requires_grad and torch.allclose(a, b.detach())
