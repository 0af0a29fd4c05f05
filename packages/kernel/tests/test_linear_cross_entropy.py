"""Fused linear cross-entropy (Triton) against the float64 unfused definition, and its chunking."""

from __future__ import annotations

import pytest
import torch
from plyx.kernel import KernelInputError
from plyx.kernel.reference import cross_entropy as ce_reference
from plyx.kernel.reference import linear_cross_entropy as reference
from plyx.kernel.triton_ops import linear_cross_entropy as fused_module
from plyx.kernel.triton_ops.linear_cross_entropy import linear_cross_entropy

from .conftest import GPU, TRITON_DEVICE

# (N, D, V, chunk): chunks that divide N, that leave a partial last chunk, and one chunk for all
SHAPES = [(9, 24, 67, 4), (13, 40, 300, 5), (6, 16, 257, 64)]
if GPU:
    SHAPES += [(1000, 512, 32003, None), (257, 1024, 50257, 64)]

OPTIONS = [{}, {"label_smoothing": 0.1, "z_loss": 1e-3, "bias": True}, {"reduction": "sum"}, {"reduction": "none", "bias": True}]


def unfused(h, w, t, *, bias=None, **options):
    """The definition: materialised logits, then cross-entropy."""
    z = h @ w.T
    return ce_reference(z if bias is None else z + bias, t, **options)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_matches_unfused_definition(parity, make, shape, dtype, options):
    n, d, v, chunk = shape
    options = dict(options)
    with_bias = options.pop("bias", False)
    t = torch.randint(0, v, (n,))
    t[torch.rand(n) < 0.2] = -100
    t = t.to(TRITON_DEVICE)
    h = make(n, d, dtype=dtype)
    w = make(v, d, dtype=dtype, scale=2 * d ** -0.5)
    args = [h, w] + ([make(v, dtype=dtype, scale=0.5)] if with_bias else [])

    def fused(h, w, b=None):
        return linear_cross_entropy(h, w, t, bias=b, chunk_size=chunk, **options)

    def definition(h, w, b=None):
        return unfused(h, w, t, bias=b, **options)

    parity(fused, definition, args, grad=tuple(range(len(args))), dtype=dtype, label=f"linear_ce {shape} {options}",
           floor=1.0)  # losses relative to max(|loss|, 1 nat), as for cross_entropy


def test_reference_is_chunked_and_matches_definition(make):
    h, w = make(10, 8, dtype=torch.float64), make(50, 8, dtype=torch.float64)
    t = torch.randint(0, 50, (10,), device=TRITON_DEVICE)
    for chunk in (1, 3, 10, 64):
        assert torch.allclose(reference(h, w, t, chunk_size=chunk), unfused(h, w, t), rtol=1e-12, atol=0)


def test_never_materialises_full_logits(make, monkeypatch):
    """Every logits buffer the fused kernel multiplies into holds at most chunk_size rows."""
    shapes = []
    real = torch.matmul

    def spy(a, b, *args, **kwargs):
        if b.dim() == 2 and b.shape[-1] == 300:  # hidden @ W^T: the logits
            shapes.append(tuple(a.shape[:-1]) + (b.shape[-1],))
        return real(a, b, *args, **kwargs)

    monkeypatch.setattr(fused_module.torch, "matmul", spy)
    h, w = make(20, 16).requires_grad_(True), make(300, 16).requires_grad_(True)
    t = torch.randint(0, 300, (20,), device=TRITON_DEVICE)
    linear_cross_entropy(h, w, t, chunk_size=8).backward()
    assert shapes and max(s[0] for s in shapes) <= 8, shapes


def test_no_gradient_path_returns_the_same_loss(make):
    h, w = make(9, 16), make(70, 16)
    t = torch.randint(0, 70, (9,), device=TRITON_DEVICE)
    with torch.no_grad():
        a = linear_cross_entropy(h, w, t, chunk_size=4)
    b = linear_cross_entropy(h.requires_grad_(True), w, t, chunk_size=4)
    assert torch.allclose(a, b.detach(), rtol=1e-6)


def test_bad_inputs_name_kernel_and_argument():
    h = torch.randn(4, 8, device=TRITON_DEVICE)
    w = torch.randn(10, 8, device=TRITON_DEVICE)
    t = torch.zeros(4, dtype=torch.long, device=TRITON_DEVICE)
    with pytest.raises(KernelInputError, match=r"linear_cross_entropy:triton.*`weight`.*\[V, D=8\]"):
        linear_cross_entropy(h, w[:, :7], t)
    with pytest.raises(KernelInputError, match=r"`weight`.*dtype"):
        linear_cross_entropy(h, w.double(), t)
    with pytest.raises(KernelInputError, match=r"`bias`.*\[V=10\]"):
        linear_cross_entropy(h, w, t, bias=torch.zeros(9, device=TRITON_DEVICE))
    with pytest.raises(KernelInputError, match=r"`hidden`.*\[N, D\]"):
        linear_cross_entropy(h[None], w, t)


@pytest.mark.parametrize("chunk", [3, None])
def test_unit_gradient_and_with_grads_match_definition(make, fresh_seed, chunk):
    """loss.backward()'s incoming 1 (scale_ leaves the forward's gradients as they are) and
    linear_cross_entropy_with_grads at an explicit chunk size, against float64."""
    from plyx.kernel.triton_ops.linear_cross_entropy import linear_cross_entropy_with_grads

    from .conftest import TOLERANCES, rel_max_err

    n, d, v = 11, 24, 150
    t = torch.randint(0, v, (n,), device=TRITON_DEVICE)
    t[2] = -100
    h, w = make(n, d), make(v, d, scale=2 * d ** -0.5)
    h64, w64 = (x.detach().double().requires_grad_(True) for x in (h, w))
    want = unfused(h64, w64, t, label_smoothing=0.1)
    want.backward()
    hl, wl = (x.detach().clone().requires_grad_(True) for x in (h, w))
    loss = linear_cross_entropy(hl, wl, t, chunk_size=chunk, label_smoothing=0.1)
    loss.backward()
    got = linear_cross_entropy_with_grads(h, w, t, chunk_size=chunk, label_smoothing=0.1)
    tol_out, tol_grad = TOLERANCES[torch.float32]
    for label, (l_, dh, dw) in {"backward": (loss, hl.grad, wl.grad), "with_grads": got[:3]}.items():
        where = f"{label} chunk={chunk} seed={fresh_seed}"
        assert rel_max_err(l_, want, floor=1.0) <= tol_out, where
        assert rel_max_err(dh, h64.grad) <= tol_grad and rel_max_err(dw, w64.grad) <= tol_grad, where


@pytest.mark.skipif(not GPU, reason="the overlapped schedule uses a second CUDA stream")
@pytest.mark.parametrize("chunk", [64, 300])
def test_overlapped_schedule_matches_serial(make, monkeypatch, chunk):
    """SCHEDULE["overlap"]: the d_weight update on a side stream gives the serial schedule's loss and gradients
    (the same kernels on the same data, ordered by events; cuBLAS may pick another algorithm per stream, so to
    bfloat16 rounding: a missed wait would read a half-written buffer and be far off)."""
    from .conftest import rel_max_err

    n, d, v = 1000, 512, 32003
    t = torch.randint(0, v, (n,), device=TRITON_DEVICE)
    h, w, b = make(n, d, dtype=torch.bfloat16), make(v, d, dtype=torch.bfloat16, scale=2 * d ** -0.5), make(v)
    got = {}
    for overlap in (False, True):
        monkeypatch.setitem(fused_module.SCHEDULE, "overlap", overlap)
        leaves = [x.detach().clone().requires_grad_(True) for x in (h, w, b)]
        loss = linear_cross_entropy(leaves[0], leaves[1], t, bias=leaves[2], chunk_size=chunk)
        loss.backward()
        got[overlap] = [loss.detach()] + [x.grad for x in leaves]
    for name, a, c in zip(("loss", "d_hidden", "d_weight", "d_bias"), got[False], got[True]):
        assert rel_max_err(c, a) <= 1e-2, name
