"""``rmsnorm_linear``: the reference and the Triton kernel against a float64 oracle written from the definition."""

from __future__ import annotations

import math

import plyx.kernel as K
import pytest
import torch
from plyx.kernel import KernelInputError, reference, registry

from .conftest import INTERPRETING, TOLERANCES, TRITON_DEVICE, rel_max_err

EPS = 1e-6


def _oracle(x, norm_weight, weight, residual, bias, swiglu, eps=EPS):
    """float64 ``(y, h)`` from first principles, row by row: mean of squares, rsqrt, weight, matmul, silu * up.

    ``h`` is rounded to x's dtype as the unfused add is (the contract); nothing else is rounded, so the
    kernel's own roundings (the normalised row, the projection) are what the tolerance must cover.
    """
    k = x.shape[-1]
    h = x if residual is None else (x.double() + residual.double()).to(x.dtype)  # [..., K], x's dtype
    rows = h.detach().double().cpu().reshape(-1, k)  # [M, K]
    w = weight.detach().double().cpu()  # [N, K]
    out = []
    for row in rows:
        rstd = 1.0 / math.sqrt(float((row * row).sum()) / k + eps)
        n = row * rstd * norm_weight.detach().double().cpu()  # [K]
        y = (w * n[None, :]).sum(1)  # [N]: one dot product per weight row
        if bias is not None:
            y = y + bias.detach().double().cpu()
        if swiglu:
            gate, up = y[: y.numel() // 2], y[y.numel() // 2:]
            y = gate / (1.0 + torch.exp(-gate)) * up  # silu(gate) * up
        out.append(y)
    y = torch.stack(out).reshape(*x.shape[:-1], -1)
    return y, h.detach().double().cpu()


def _inputs(lead, k, n, *, dtype, residual, bias, device=TRITON_DEVICE):
    """x [*lead, K] and its residual of unit scale, norm weight around 1, weight scaled so that y is O(1)."""
    x = torch.randn(*lead, k).to(device, dtype)
    r = torch.randn(*lead, k).to(device, dtype) if residual else None
    nw = (1.0 + 0.1 * torch.randn(k)).to(device, dtype)
    w = (torch.randn(n, k) / math.sqrt(k)).to(device, dtype)
    b = torch.randn(n).to(device, dtype) if bias else None
    return x, nw, w, r, b


def _check(fn, lead, k, n, *, dtype, residual, bias, swiglu, where, tol=None, **kw):
    x, nw, w, r, b = _inputs(lead, k, n, dtype=dtype, residual=residual, bias=bias)
    before = (x.clone(), None if r is None else r.clone())
    want_y, want_h = _oracle(x, nw, w, r, b, swiglu)
    y, h = fn(x, nw, w, eps=EPS, residual=r, bias=b, swiglu=swiglu, **kw)
    tol = tol or TOLERANCES[dtype][0]
    assert y.shape == want_y.shape and y.dtype == dtype, f"{where}: y {tuple(y.shape)} {y.dtype}"
    assert h.shape == x.shape and h.dtype == dtype, f"{where}: h {tuple(h.shape)} {h.dtype}"
    assert torch.equal(x, before[0]) and (r is None or torch.equal(r, before[1])), f"{where}: an input was modified"
    # relative to at least 1, the scale of the projection (unit-RMS rows, weights of 1/sqrt(K)): a SwiGLU of
    # a few outputs can have a small max |y|, and bf16 roundings (which the interpreter truncates) are 2^-9 of
    # the gate and up values, not of their product
    assert (err := rel_max_err(y, want_y, floor=1.0)) <= tol, f"{where}: y error {err:.2e} > {tol:.0e}"
    if r is None:
        # no add: h is x itself (or a view of its storage), never a copy
        assert h is x or h.data_ptr() == x.data_ptr(), f"{where}: h is a copy of x"
    else:
        # h is the plain add rounded to x's dtype: exact on the float path; the interpreter's bf16 cast truncates
        # where PyTorch rounds to nearest, so allow one bf16 unit there
        h_tol = 0.0 if dtype == torch.float32 else 2.0 ** -7
        assert (err := rel_max_err(h, want_h)) <= h_tol, f"{where}: h error {err:.2e} > {h_tol:.0e}"


# (leading dims, K, N, residual, bias, swiglu): K of 70, 100 and 3000 are not multiples of any block
REFERENCE_CASES = [
    ((1, 1), 64, 24, True, False, False),  # decode [B=1, T=1, K]
    ((2,), 70, 12, False, True, False),  # two rows, K odd-sized
    ((1, 2), 100, 20, True, True, True),  # [1, 2, K] packed MLP with bias
    ((1, 1), 3000, 10, False, False, True),  # long K, SwiGLU without residual
    ((3, 2), 48, 16, True, False, True),  # 6 rows: the reference has no row limit
]


@pytest.mark.parametrize("case", REFERENCE_CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reference_matches_the_oracle(case, dtype, fresh_seed):
    lead, k, n, residual, bias, swiglu = case
    _check(reference.rmsnorm_linear, lead, k, n, dtype=dtype, residual=residual, bias=bias, swiglu=swiglu,
           where=f"reference {case} {dtype} seed={fresh_seed}")


# (leading dims, K, N, residual, bias, swiglu, blocks: None = pick_blocks)
TRITON_CASES = [
    ((1, 1), 64, 24, True, False, False, None),  # M=1, one K chunk
    ((2,), 70, 13, False, True, False, (4, 64, 4)),  # M=2, two K chunks, N=13 not a multiple of BLOCK_N
    ((1, 2), 100, 22, True, True, True, (8, 32, 4)),  # four K chunks, N/2=11 straddles BLOCK_N=8, bias of both halves
    ((1, 1), 3000, 10, True, False, True, None),  # long K: three 1024-wide chunks, the last partial
    ((2,), 100, 16, True, True, False, (4, 64, 4)),  # M=2 with residual: h written by program 0 only, read by all
]


@pytest.mark.parametrize("case", TRITON_CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_matches_the_oracle(case, dtype, fresh_seed):
    from plyx.kernel.triton_ops._common import poisoned
    from plyx.kernel.triton_ops.rmsnorm_linear import rmsnorm_linear

    lead, k, n, residual, bias, swiglu, blocks = case
    kw = {} if blocks is None else {"blocks": blocks}
    tol = TOLERANCES[dtype][0]
    if INTERPRETING and dtype == torch.bfloat16:
        # the interpreter truncates every cast to bf16 (h, the normalised row, y) where a GPU rounds to nearest:
        # each rounding is biased by -2^-9 instead of centred, so they add up (K=3000 SwiGLU reaches 1.8e-2 over
        # 200 seeds); twice the tolerance on CPU, the GPU run keeps the table's
        tol *= 2
    with poisoned():
        _check(rmsnorm_linear, lead, k, n, dtype=dtype, residual=residual, bias=bias, swiglu=swiglu,
               where=f"triton {case} {dtype} seed={fresh_seed}", tol=tol, **kw)


def test_triton_agrees_with_the_reference_on_the_unfused_rounding(fresh_seed):
    """Without SwiGLU both sides round the same normalised bf16 row: they agree far inside the oracle tolerance."""
    from plyx.kernel.triton_ops.rmsnorm_linear import rmsnorm_linear

    x, nw, w, r, b = _inputs((2,), 96, 12, dtype=torch.bfloat16, residual=True, bias=True)
    got = rmsnorm_linear(x, nw, w, eps=EPS, residual=r, bias=b, blocks=(4, 32, 4))
    want = reference.rmsnorm_linear(x.cpu(), nw.cpu(), w.cpu(), eps=EPS, residual=r.cpu(), bias=b.cpu())
    assert rel_max_err(got[0], want[0], floor=1.0) <= TOLERANCES[torch.bfloat16][0], f"seed={fresh_seed}"


def test_pick_blocks_covers_k_and_spreads_n():
    from plyx.kernel.triton_ops.rmsnorm_linear import pick_blocks

    for n, k in ((2560, 2048), (11264, 2048), (32000, 2048), (10, 3000), (24, 70)):
        block_n, block_k, warps = pick_blocks(n, k)
        assert block_k & (block_k - 1) == 0 and block_n & (block_n - 1) == 0, (n, k)
        assert block_k >= min(k, 1024) and warps in (1, 2, 4, 8, 16), (n, k)


def test_triton_refuses_more_rows_than_its_limit():
    from plyx.kernel.triton_ops.rmsnorm_linear import MAX_ROWS, rmsnorm_linear

    x, nw, w, _, _ = _inputs((1, MAX_ROWS + 1), 32, 8, dtype=torch.float32, residual=False, bias=False)
    with pytest.raises(ValueError, match=rf"at most {MAX_ROWS} rows, got {MAX_ROWS + 1}"):
        rmsnorm_linear(x, nw, w)


def test_registry_limits_triton_to_two_rows_and_dispatch_takes_three_on_cpu(fresh_seed):
    impls = {i.impl: i for i in registry().implementations("rmsnorm_linear")}
    assert set(impls) >= {"reference", "triton"}
    assert impls["triton"].capability.shape_limits == {"rows": (1, 2)}  # so rows=3 never reaches the kernel's ValueError
    assert not impls["triton"].capability.backward
    x, nw, w, r, b = _inputs((3,), 40, 10, dtype=torch.float32, residual=True, bias=True, device="cpu")
    assert registry().get("rmsnorm_linear", x, nw, w, rows=3, hidden=40) is reference.rmsnorm_linear
    want_y, want_h = _oracle(x, nw, w, r, b, swiglu=True)
    y, h = K.rmsnorm_linear(x, nw, w, eps=EPS, residual=r, bias=b, swiglu=True)
    assert y.shape == (3, 5) and rel_max_err(y, want_y) <= TOLERANCES[torch.float32][0], f"seed={fresh_seed}"
    assert torch.equal(h.double(), want_h)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_bad_inputs_name_the_argument(impl):
    if impl == "triton":
        from plyx.kernel.triton_ops.rmsnorm_linear import rmsnorm_linear as fn
    else:
        fn = reference.rmsnorm_linear
    x, nw, w, r, b = _inputs((1, 2), 32, 8, dtype=torch.float32, residual=True, bias=True)
    with pytest.raises(KernelInputError, match=rf"rmsnorm_linear:{impl}.*`weight`.*K=32.*\[8, 31\]"):
        fn(x, nw, w[:, :31], residual=r)
    with pytest.raises(KernelInputError, match=r"`weight`.*even N.*N=7"):
        fn(x, nw, w[:7], swiglu=True)
    with pytest.raises(KernelInputError, match=r"`bias`.*N=8.*\[7\]"):
        fn(x, nw, w, bias=b[:7])
    with pytest.raises(KernelInputError, match=r"`residual`.*\[2, 32\].*\[1, 2, 32\]"):
        fn(x, nw, w, residual=r[0])
    with pytest.raises(KernelInputError, match=r"`norm_weight`.*\[31\]"):
        fn(x, nw[:31], w)
    with pytest.raises(KernelInputError, match=r"`x`.*no gradient.*torch.no_grad"):
        fn(x.clone().requires_grad_(), nw, w)
    with torch.no_grad():  # outside grad mode a tensor that requires grad is fine
        fn(x.clone().requires_grad_(), nw, w.clone().requires_grad_())


def test_triton_reads_a_strided_bias_or_refuses_it(fresh_seed):
    from plyx.kernel.triton_ops.rmsnorm_linear import rmsnorm_linear

    x, nw, w, _, _ = _inputs((1,), 32, 8, dtype=torch.float32, residual=False, bias=False)
    b = torch.randn(16, device=TRITON_DEVICE)[::2]  # [8], stride 2: e.g. a slice of a packed bias
    try:
        y, _ = rmsnorm_linear(x, nw, w, bias=b)
    except KernelInputError as e:  # refusing it, naming `bias`, is as good as reading it
        assert e.argument == "bias"
        return
    assert rel_max_err(y, _oracle(x, nw, w, None, b, False)[0]) <= TOLERANCES[torch.float32][0], f"seed={fresh_seed}"


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_errors_name_norm_weight_and_the_tensor_that_requires_grad(impl):
    if impl == "triton":
        from plyx.kernel.triton_ops.rmsnorm_linear import rmsnorm_linear as fn
    else:
        fn = reference.rmsnorm_linear
    x, nw, w, _, _ = _inputs((1,), 32, 8, dtype=torch.float32, residual=False, bias=False)
    with pytest.raises(KernelInputError) as err:
        fn(x, nw[:31], w)
    assert err.value.argument == "norm_weight"
    with pytest.raises(KernelInputError) as err:
        fn(x, nw, w.clone().requires_grad_())
    assert err.value.argument == "weight"
