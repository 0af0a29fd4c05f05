"""``lora_matmul`` (Triton BGMV) against a float64 oracle written from the definition, over odd shapes, ranks,
adapter counts, base rows and dtypes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from .conftest import TRITON_DEVICE, rel_max_err

#: error allowed relative to the oracle's largest magnitude, per dtype: float64 accumulates in float64;
#: float32 in float32 (two dot products of length <= 300); bfloat16 inputs round the rank-r intermediate once.
#: float32's bound is relative to sum |A x| terms, not to the result: at rank 1 every output is one intermediate
#: h = A x times B, so when h's terms cancel (h ~ 1% of them) its float32 rounding, and every output's, is ~100x
#: the unit roundoff times the length (seen: 1.3e-5 at [1, 8] rank 1); 1e-4 keeps a 10x margin over that
TOL = {torch.float64: 1e-12, torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _oracle(x, A, B, index):
    """float64 ``B[a] @ (A[a] @ x[i])`` per row, zeros for ``a < 0``."""
    x, A, B = x.double().cpu(), A.double().cpu(), B.double().cpu()
    rows = [B[a] @ (A[a] @ x[i]) if a >= 0 else torch.zeros(B.shape[1], dtype=torch.float64)
            for i, a in enumerate(index.tolist())]
    return torch.stack(rows)


# (rows, in, out, n adapters, rank): 1 row; in/out not multiples of any block (41, 300, 33, 97); rank 1 and 16
CASES = [(1, 8, 8, 1, 1), (9, 41, 33, 3, 4), (17, 300, 97, 5, 16), (4, 64, 130, 2, 8)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_lora_matmul_matches_the_oracle(fresh_seed, case, dtype):
    from plyx.kernel.triton_ops.lora_matmul import lora_matmul

    n_rows, d_in, d_out, n, r = case
    x = torch.randn(n_rows, d_in).to(TRITON_DEVICE, dtype)
    A = (torch.randn(n, r, d_in) / d_in ** 0.5).to(TRITON_DEVICE, dtype)
    B = torch.randn(n, d_out, r).to(TRITON_DEVICE, dtype)
    index = torch.randint(-1, n, (n_rows,), device=TRITON_DEVICE)
    index[0] = n - 1  # at least one adapted row
    y = lora_matmul(x, A, B, index)
    assert y.shape == (n_rows, d_out) and y.dtype == dtype
    err = rel_max_err(y, _oracle(x, A, B, index))
    assert err <= TOL[dtype], f"seed {fresh_seed}: {err}"
    base = (index < 0).nonzero()[:, 0]
    assert (y[base] == 0).all()  # the base rows get no update at all


def test_bad_shapes_are_named():
    from plyx.kernel.triton_ops.lora_matmul import bgmv

    with pytest.raises(ValueError, match=r"W \[n, O, K\]"):
        bgmv(torch.randn(2, 8), torch.randn(1, 4, 9), torch.zeros(2, dtype=torch.long))
