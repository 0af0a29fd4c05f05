"""``gemv``: the reference and the Triton kernel against a float64 oracle written from the definition."""

from __future__ import annotations

import math

import plyx.kernel as K
import pytest
import torch
from plyx.kernel import KernelInputError, reference, registry

from .conftest import GPU, INTERPRETING, TOLERANCES, TRITON_DEVICE, rel_max_err


def _oracle(x, weight, bias):
    """float64 ``x @ weight^T (+ bias)``."""
    y = x.double().cpu() @ weight.double().cpu().T  # [..., N]
    return y if bias is None else y + bias.double().cpu()


def _inputs(lead, k, n, dtype, bias, device=TRITON_DEVICE):
    x = (2.0 * torch.randn(*lead, k)).to(device, dtype)
    w = (torch.randn(n, k) / math.sqrt(max(k, 1))).to(device, dtype)
    b = torch.randn(n).to(device, dtype) if bias else None
    return x, w, b


# (leading dims, K, N, bias): K of 70 and 3000 are not multiples of any block (3000 > the default 2048-wide
# chunk, so the pipelined loop runs); N of 13 and 10 not of BLOCK_N; (2,) and (1, 2) are the two-row cases
CASES = [((1, 1), 64, 24, False), ((2,), 70, 13, True), ((1, 2), 40, 16, False), ((1, 1), 3000, 10, True),
         ((1,), 1, 5, True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_reference_matches_the_oracle(fresh_seed, case, dtype):
    lead, k, n, bias = case
    x, w, b = _inputs(lead, k, n, dtype, bias, device="cpu")
    y = reference.gemv(x, w, bias=b)
    assert y.shape == (*lead, n) and y.dtype == dtype
    tol = TOLERANCES[dtype][0]
    assert (err := rel_max_err(y, _oracle(x, w, b), floor=1.0)) <= tol, f"seed={fresh_seed}: {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("blocks", [None, (4, 32, 4, 2)], ids=["default", "small-blocks"])
def test_triton_matches_the_oracle(fresh_seed, case, dtype, blocks):
    from plyx.kernel.triton_ops._common import poisoned
    from plyx.kernel.triton_ops.gemv import gemv

    lead, k, n, bias = case
    x, w, b = _inputs(lead, k, n, dtype, bias)
    before = x.clone()
    with poisoned():  # an output element the kernel never writes stays NaN and fails the check
        y = gemv(x, w, bias=b, blocks=blocks)
    assert y.shape == (*lead, n) and y.dtype == dtype
    assert torch.equal(x, before)
    # the interpreter truncates bf16 casts where a GPU rounds to nearest: twice the tolerance there
    tol = TOLERANCES[dtype][0] * (2 if INTERPRETING and dtype == torch.bfloat16 else 1)
    assert (err := rel_max_err(y, _oracle(x, w, b), floor=1.0)) <= tol, f"seed={fresh_seed}: {err:.2e} > {tol:.0e}"


def test_triton_reads_a_row_strided_weight_view_and_strided_rows_of_x(fresh_seed):
    """A view of a packed weight (rows of a wider matrix) and rows of x with a gap between them."""
    from plyx.kernel.triton_ops._common import poisoned
    from plyx.kernel.triton_ops.gemv import gemv

    packed = torch.randn(3 * 19, 50).to(TRITON_DEVICE)
    w = packed.view(3, 19, 50)[:, :, 3:43].reshape(57, 40)[5:24]  # [19, 40], row stride 50
    assert w.stride() == (50, 1) and not w.is_contiguous()
    x = torch.randn(2, 64).to(TRITON_DEVICE)[:, 7:47]  # [2, 40], row stride 64
    b = torch.randn(19).to(TRITON_DEVICE)
    with poisoned():
        y = gemv(x, w, bias=b, blocks=(8, 16, 4, 2))
    assert (err := rel_max_err(y, _oracle(x, w, b), floor=1.0)) <= 1e-4, f"seed={fresh_seed}: {err:.2e}"


def test_triton_mixes_dtypes_as_the_reference_does(fresh_seed):
    """A bf16 weight with float32 x: both compute in float32 from the same bf16 weight values, output in x's dtype."""
    from plyx.kernel.triton_ops.gemv import gemv

    x, w, b = _inputs((1,), 48, 12, torch.float32, True)
    w = w.to(torch.bfloat16)
    y = gemv(x, w, bias=b, blocks=(4, 16, 4, 2))
    assert y.dtype == torch.float32
    assert (err := rel_max_err(y, reference.gemv(x.cpu(), w.cpu(), bias=b.cpu()), floor=1.0)) <= 1e-4, \
        f"seed={fresh_seed}: {err:.2e}"


def test_pick_blocks_follows_the_sweep():
    from plyx.kernel.triton_ops.gemv import pick_blocks

    assert pick_blocks(2048, 2048) == (8, 2048, 8, 3)  # the output projection
    assert pick_blocks(2048, 5632) == (4, 2048, 8, 3)  # the down projection
    assert pick_blocks(24, 70)[1] == 128  # a short row takes one chunk of its own next power of two
    assert pick_blocks(5, 0)[1] == 1  # no empty arange


def test_empty_inputs_give_empty_or_bias_only_outputs():
    from plyx.kernel.triton_ops.gemv import gemv

    x, w, b = _inputs((0,), 16, 8, torch.float32, True)
    assert gemv(x, w, bias=b).shape == (0, 8)
    x, w, b = _inputs((1,), 0, 8, torch.float32, True)
    assert torch.equal(gemv(x, w, bias=b).cpu(), b.cpu()[None, :])  # K=0: the sum is empty


def test_triton_takes_two_rows_and_the_registry_sends_more_to_the_reference():
    from plyx.kernel.triton_ops.gemv import gemv

    x, w, _ = _inputs((3,), 16, 8, torch.float32, False)
    with pytest.raises(ValueError, match="at most 2 rows, got 3"):
        gemv(x, w)
    impls = {i.impl: i for i in registry().implementations("gemv")}
    assert impls["triton"].capability.shape_limits == {"rows": (1, 2)} and not impls["triton"].capability.backward
    cpu_x, cpu_w, _ = _inputs((3,), 16, 8, torch.float32, False, device="cpu")
    assert registry().get("gemv", cpu_x, cpu_w, rows=3, hidden=16) is reference.gemv
    assert rel_max_err(K.gemv(cpu_x, cpu_w), _oracle(cpu_x, cpu_w, None), floor=1.0) <= 1e-5


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_bad_inputs_name_the_argument(impl):
    if impl == "triton":
        from plyx.kernel.triton_ops.gemv import gemv as fn
    else:
        fn = reference.gemv
    x, w, b = _inputs((1,), 16, 8, torch.float32, True)
    with pytest.raises(KernelInputError, match=r"`x`.*scalar"):
        fn(x[0, 0], w)
    with pytest.raises(KernelInputError, match=r"`weight`.*K=16"):
        fn(x, w[:, :15])
    with pytest.raises(KernelInputError, match=r"`weight`.*K=16"):
        fn(x, w[0])
    with pytest.raises(KernelInputError, match=r"`bias`.*N=8"):
        fn(x, w, bias=b[:7])
    with pytest.raises(KernelInputError, match=r"`x`.*dtype int64"):
        fn(x.long(), w)
    with pytest.raises(KernelInputError) as err:
        fn(x, w.clone().requires_grad_())
    assert err.value.argument == "weight" and "no gradient" in str(err.value)
    with torch.no_grad():  # outside grad mode a tensor that requires grad is fine
        fn(x, w.clone().requires_grad_())


def test_triton_refuses_a_strided_last_dim():
    from plyx.kernel.triton_ops.gemv import gemv

    x, w, _ = _inputs((1,), 16, 8, torch.float32, False)
    with pytest.raises(KernelInputError, match=r"`weight`.*stride 8"):
        gemv(x, w.t().contiguous().t())
    with pytest.raises(KernelInputError, match=r"`x`.*stride 2"):
        gemv(torch.randn(1, 32).to(TRITON_DEVICE)[:, ::2], w)


@pytest.mark.skipif(not GPU, reason="needs CUDA: compiled kernel, the registry's CUDA choice, CUDA-graph capture")
def test_gpu_selects_triton_and_captures_in_a_graph(fresh_seed):
    x, w, b = _inputs((1, 1), 2048, 2048, torch.bfloat16, True, device="cuda")
    with torch.inference_mode():
        assert registry().select("gemv", K.query_for("gemv", x, w, rows=1, hidden=2048)).impl == "triton"
        want = _oracle(x, w, b)
        y = K.gemv(x, w, bias=b)  # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = K.gemv(x, w, bias=b)
        x.copy_(2.0 * torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
    assert rel_max_err(y, want, floor=1.0) <= TOLERANCES[torch.bfloat16][0]
    assert rel_max_err(out, _oracle(x, w, b), floor=1.0) <= TOLERANCES[torch.bfloat16][0], f"seed={fresh_seed}"
