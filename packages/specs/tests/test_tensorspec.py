"""TensorSpec on numpy arrays (no torch): shapes, symbolic binding, dtype, layout."""

from __future__ import annotations

import numpy as np
import pytest
from plyx.specs import Batch, TensorSpec, TensorSpecError, bind, dtype_name

Q = TensorSpec(("B", "T", "H", "Dh"), dtype=("float32", "float16"), layout="contiguous", name="q")
MASK = TensorSpec(("B", "T"), dtype="bool", name="mask")


def test_binding_across_tensors():
    rng = np.random.default_rng()
    b, t = rng.integers(1, 5), rng.integers(1, 9)
    q = rng.standard_normal((b, t, 4, 8)).astype(np.float32)
    mask = np.ones((b, t), bool)
    assert bind(q=(Q, q), mask=(MASK, mask)) == {"B": b, "T": t, "H": 4, "Dh": 8}


def test_mismatched_symbol_names_tensor_dim_and_both_sizes():
    q = np.zeros((2, 5, 4, 8), np.float32)
    mask = np.zeros((2, 6), bool)
    with pytest.raises(TensorSpecError) as info:
        bind(q=(Q, q), mask=(MASK, mask))
    msg = str(info.value)
    assert info.value.tensor == "mask" and "T" in msg and "6" in msg and "T=5" in msg


def test_rank_fixed_dims_and_wildcards():
    spec = TensorSpec((None, 3, "N"))
    assert spec.validate(np.zeros((7, 3, 2))) == {"N": 2}
    with pytest.raises(TensorSpecError, match="dim 1 must be 3"):
        spec.validate(np.zeros((7, 4, 2)))
    with pytest.raises(TensorSpecError, match="expected 3 dims"):
        spec.validate(np.zeros((7, 3)))


def test_leading_ellipsis():
    spec = TensorSpec(("...", "D"))
    assert spec.validate(np.zeros((2, 3, 5))) == {"D": 5}
    assert spec.rank is None


def test_dtype_and_layout():
    with pytest.raises(TensorSpecError, match="dtype must be one of float32, float16, got float64"):
        Q.validate(np.zeros((1, 2, 3, 4)))
    transposed = np.zeros((1, 3, 2, 4), np.float32).transpose(0, 2, 1, 3)
    with pytest.raises(TensorSpecError, match=r"contiguous\(\)"):
        Q.validate(transposed)


def test_dtype_names_are_canonical():
    assert dtype_name("torch.bfloat16") == "bfloat16"
    assert dtype_name(np.dtype("float16")) == "float16"
    assert dtype_name("fp32") == "float32"
    assert TensorSpec(("N",), dtype="bf16").dtype == ("bfloat16",)


def test_not_a_tensor():
    with pytest.raises(TensorSpecError, match="expected a tensor"):
        Q.validate([1, 2, 3])


def test_batch_validates_its_fields():
    ids = np.zeros((2, 8), np.int64)
    batch = Batch(input_ids=ids, targets=ids, document_ids=np.zeros((2, 8), np.int64))
    assert batch.validate() == {"B": 2, "T": 8}
    assert batch.num_tokens == 16
    bad = Batch(input_ids=ids, targets=np.zeros((2, 7), np.int64))
    with pytest.raises(TensorSpecError, match="targets"):
        bad.validate()
    with pytest.raises(TensorSpecError, match="dtype"):
        Batch(input_ids=ids.astype(np.float32), targets=ids).validate()
