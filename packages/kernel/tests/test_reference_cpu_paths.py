"""The references' CPU fast paths (nanoGPT's CPU recipe, issue 20) against their plain definitions, in float64.

Each fast path must give the values and gradients of the formula it replaces: the one-block
linear cross-entropy against the chunked one, the fused q/k rotation against ``rope`` on each
tensor (autograd through the rotate-half ops), the closed-form RMSNorm against autograd through
its ops; and the rotate-half table cache must never serve tables that changed.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from plyx.kernel import reference, rope_tables

F64 = torch.float64
#: the module (the package's ``rope`` name is the function)
rope_module = importlib.import_module("plyx.kernel.reference.rope")


def _grads(out: torch.Tensor | tuple[torch.Tensor, ...], inputs: list[torch.Tensor], seed: int = 0):
    outs = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator().manual_seed(seed)
    cot = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in outs]
    return torch.autograd.grad(outs, inputs, cot)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_one_block_linear_cross_entropy_is_the_chunked_one(reduction, smoothing):
    torch.manual_seed(0)
    h = torch.randn(7, 5, dtype=F64, requires_grad=True)
    w = torch.randn(11, 5, dtype=F64, requires_grad=True)
    b = torch.randn(11, dtype=F64, requires_grad=True)
    t = torch.randint(0, 11, (7,))
    t[2] = -100
    kw = {"bias": b, "label_smoothing": smoothing, "reduction": reduction}
    fast = reference.linear_cross_entropy(h, w, t, **kw)  # default chunk: one block
    chunked = reference.linear_cross_entropy(h, w, t, chunk_size=3, **kw)
    torch.testing.assert_close(fast, chunked, rtol=1e-12, atol=1e-12)
    for a, c in zip(_grads(fast, [h, w, b]), _grads(chunked, [h, w, b])):
        torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-12)


def test_one_block_mean_over_no_valid_target_is_zero():
    h = torch.randn(3, 4, dtype=F64, requires_grad=True)
    w = torch.randn(6, 4, dtype=F64)
    loss = reference.linear_cross_entropy(h, w, torch.full((3,), -100))
    assert loss.item() == 0.0
    assert torch.equal(torch.autograd.grad(loss, h)[0], torch.zeros_like(h))


@pytest.mark.parametrize("kv", [4, 2, 1])
def test_rope_qk_fused_rotation_matches_rope_on_each(kv):
    torch.manual_seed(1)
    q = torch.randn(2, 5, 4, 8, dtype=F64, requires_grad=True)
    k = torch.randn(2, 5, kv, 8, dtype=F64, requires_grad=True)
    cos, sin = rope_tables(torch.arange(5), 8, 100.0, dtype=F64)
    fast = reference.rope_qk(q, k, cos, sin)
    assert type(fast[0].grad_fn).__name__ == "_RotateBackward"  # the fast path was taken
    plain = (_rope_formula(q, cos, sin), _rope_formula(k, cos, sin))  # autograd through the ops
    for a, c in zip(fast, plain):
        torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-12)
    for a, c in zip(_grads(fast, [q, k]), _grads(plain, [q, k])):
        torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-12)
    # one output unused: its gradient is None, the other still flows
    (gq,) = torch.autograd.grad(reference.rope_qk(q, k, cos, sin)[0].sum(), [q])
    torch.testing.assert_close(gq, torch.autograd.grad(_rope_formula(q, cos, sin).sum(), [q])[0])


def test_rmsnorm_closed_form_matches_autograd_through_the_ops():
    torch.manual_seed(2)
    x = torch.randn(3, 4, 16, dtype=F64, requires_grad=True)
    r = torch.randn(3, 4, 16, dtype=F64, requires_grad=True)
    w = torch.randn(16, dtype=F64, requires_grad=True)
    y, h = reference.rmsnorm(x, w, eps=1e-6, residual=r)
    hh = x + r
    ref = hh * torch.rsqrt(hh.square().mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h, hh)
    for a, c in zip(_grads(y, [x, r, w]), _grads(ref, [x, r, w])):
        torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-12)


def test_half_tables_cache_never_serves_changed_or_other_tables():
    cos, sin = rope_tables(torch.arange(4), 8, 100.0)
    first = rope_module.half_tables(cos, sin, torch.float32)
    assert rope_module.half_tables(cos, sin, torch.float32) is first  # the same tensors: remembered
    cos.mul_(2.0)  # changed in place: its version moved on
    again = rope_module.half_tables(cos, sin, torch.float32)
    assert again is not first
    torch.testing.assert_close(again[0][0, :, 0, :4], cos)
    other_cos, other_sin = cos.clone(), sin.clone() * 3  # equal-looking but other objects
    torch.testing.assert_close(rope_module.half_tables(other_cos, other_sin, torch.float32)[1][0, :, 0, 4:], sin * 3)
    assert rope_module.half_tables(cos, sin, torch.float64)[0].dtype == torch.float64  # per dtype


def test_half_tables_cache_drops_entries_with_their_tables():
    cos, sin = rope_tables(torch.arange(3), 8, 100.0)
    rope_module.half_tables(cos, sin, torch.float32)
    key = (id(cos), id(sin), torch.float32, 1)
    assert key in rope_module._HALF_CACHE
    del cos  # the cos tensor dies: its derived tables are not kept
    assert key not in rope_module._HALF_CACHE
    big_cos, big_sin = rope_tables(torch.arange(rope_module._HALF_CACHE_NUMEL // 4 + 1), 8, 100.0)
    rope_module.half_tables(big_cos, big_sin, torch.float32)
    assert (id(big_cos), id(big_sin), torch.float32, 1) not in rope_module._HALF_CACHE  # too large to keep


def _rope_formula(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE written out: ``(a cos - b sin, b cos + a sin)`` over the first R dims."""
    r = 2 * cos.shape[-1]
    c = (cos if cos.dim() == 3 else cos[None])[:, :, None, :]  # (B|1, T, 1, R/2)
    s = (sin if sin.dim() == 3 else sin[None])[:, :, None, :]
    a, b = x[..., : r // 2], x[..., r // 2: r]
    return torch.cat((a * c - b * s, b * c + a * s, x[..., r:]), dim=-1)


@pytest.mark.parametrize("heads", [1, 3, 6])
def test_rope_single_tensor_training_path_matches_the_formula(heads):
    """``rope`` on a tensor that needs a gradient (q and k side by side, a view of a stacked projection) takes the
    one-Function path with per-head tables; values and gradients are the formula's, in float64."""
    torch.manual_seed(3)
    qkv = torch.randn(2, 5, heads + 2, 8, dtype=F64, requires_grad=True)
    x = qkv[:, :, :heads]  # a strided view, as Attention's q and k of one GEMM
    cos, sin = rope_tables(torch.arange(5), 8, 100.0, dtype=F64)
    fast = reference.rope(x, cos, sin)
    assert type(fast.grad_fn).__name__ == "_RotateOneBackward"  # the fast path was taken
    plain = _rope_formula(x, cos, sin)
    torch.testing.assert_close(fast, plain, rtol=1e-12, atol=1e-12)
    for a, c in zip(_grads(fast, [qkv]), _grads(plain, [qkv])):
        torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-12)
    # per-row tables and partial rotary keep the general path, with the same values
    rows_cos, rows_sin = rope_tables(torch.arange(10).view(2, 5), 8, 100.0, dtype=F64)
    torch.testing.assert_close(reference.rope(x, rows_cos, rows_sin), _rope_formula(x, rows_cos, rows_sin))
    part_cos, part_sin = rope_tables(torch.arange(5), 4, 100.0, dtype=F64)
    torch.testing.assert_close(reference.rope(x, part_cos, part_sin), _rope_formula(x, part_cos, part_sin))
    assert torch.autograd.gradcheck(lambda t: reference.rope(t, cos, sin), (x.detach().clone().requires_grad_(),))


def test_half_tables_per_head_are_the_broadcast_ones():
    cos, sin = rope_tables(torch.arange(4), 8, 100.0)
    one = rope_module.half_tables(cos, sin, torch.float32)
    four = rope_module.half_tables(cos, sin, torch.float32, heads=4)
    assert four[0].shape == (1, 4, 4, 8) and four[0].is_contiguous()
    for a, b in zip(one, four):
        torch.testing.assert_close(a.expand_as(b), b, rtol=0, atol=0)
    rows_cos, rows_sin = rope_tables(torch.arange(8).view(2, 4), 8, 100.0)  # per-row tables: never repeated
    assert rope_module.half_tables(rows_cos, rows_sin, torch.float32, heads=4)[0].shape == (2, 4, 1, 8)


@pytest.mark.parametrize("wanted", ["x", "weight", "both"])
def test_rmsnorm_closed_form_each_gradient_alone_matches_autograd(wanted):
    """The closed-form backward with each gradient alone and both, over leading shapes, against autograd through
    the formula in float64 (and ``gradcheck``)."""
    torch.manual_seed(4)
    x = torch.randn(2, 3, 5, 24, dtype=F64, requires_grad=wanted in ("x", "both"))
    w = torch.randn(24, dtype=F64, requires_grad=wanted in ("weight", "both"))
    y = reference.rmsnorm(x, w, eps=1e-5)
    ref = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-5) * w
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    inputs = [t for t in (x, w) if t.requires_grad]
    for a, c in zip(_grads(y, inputs), _grads(ref, inputs)):
        torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(lambda *t: reference.rmsnorm(*t, eps=1e-5), (x, w))


@pytest.mark.parametrize("bad", [68, -3])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_one_block_loss_answers_a_bad_target_with_the_clear_error(bad, smoothing):
    """The CPU one-block loss leaves the target bounds check to ``F.cross_entropy`` (no extra pass); an id outside
    [0, V) that is not ignore_index still gets the message naming it and the fix."""
    from plyx.kernel._errors import KernelInputError

    h = torch.randn(6, 4, dtype=F64, requires_grad=True)
    w = torch.randn(68, 4, dtype=F64)
    t = torch.tensor([1, 2, -100, bad, 5, 6])
    with pytest.raises(KernelInputError, match=f"holds id {bad} outside \\[0, 68\\)"):
        reference.linear_cross_entropy(h, w, t, label_smoothing=smoothing)
