"""The reference ``attention`` / ``paged_attention``: the specification itself, checked independently.

- float64 gradcheck for every feature (causal, window, documents, masks, GQA, T < S);
- parity with a naive per-query loop written from the contract's words;
- the SDPA backend against the reference on the same features;
- the paged reference against the dense reference on the gathered cache.
"""

from __future__ import annotations

import math

import pytest
import torch
from plyx.kernel.attention import attention_reference, attention_sdpa, paged_attention_reference

from .conftest import rel_err


def _naive(q, k, v, *, causal=True, scale=None, mask=None, document_ids=None, window=None):
    """The contract, one query at a time, in float64 (independent of the reference's vectorised code)."""
    B, T, H, D = q.shape
    S, KV = k.shape[1], k.shape[2]
    scale = D**-0.5 if scale is None else scale
    out = torch.zeros(B, T, H, D, dtype=torch.float64)
    lse = torch.full((B, H, T), float("-inf"), dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            kvh = h // (H // KV)
            for i in range(T):
                pos = i + S - T
                logits, values = [], []
                for j in range(S):
                    if causal and j > pos:
                        continue
                    if window is not None and pos - j >= window:
                        continue
                    if document_ids is not None and document_ids[b, i] != document_ids[b, j]:
                        continue
                    s = scale * float(q[b, i, h].double() @ k[b, j, kvh].double())
                    if mask is not None:
                        m = mask[min(b, mask.shape[0] - 1), min(h, mask.shape[1] - 1), i, j]
                        if mask.dtype == torch.bool:
                            if not m:
                                continue
                        else:
                            s += float(m)
                    if s == float("-inf"):
                        continue
                    logits.append(s)
                    values.append(v[b, j, kvh].double())
                if logits:
                    mx = max(logits)
                    w = torch.tensor([math.exp(x - mx) for x in logits], dtype=torch.float64)
                    out[b, i, h] = (w[:, None] * torch.stack(values)).sum(0) / w.sum()
                    lse[b, h, i] = mx + math.log(float(w.sum()))
    return out, lse


def _inputs(B, T, S, H, KV, D, dtype=torch.float64, grad=False):
    q = torch.randn(B, T, H, D, dtype=dtype, requires_grad=grad)
    k = torch.randn(B, S, KV, D, dtype=dtype, requires_grad=grad)
    v = torch.randn(B, S, KV, D, dtype=dtype, requires_grad=grad)
    return q, k, v


def _docs(B, T, n_docs=3):
    # sorted random ids: contiguous documents, some of length 1
    return torch.sort(torch.randint(0, n_docs, (B, T)), dim=1).values


FEATURES = {
    "causal": dict(causal=True),
    "full": dict(causal=False),
    "window": dict(causal=True, window=3),
    "window_full": dict(causal=False, window=2),
    "scale": dict(causal=True, scale=0.3),
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("T,S,H,KV", [(5, 5, 2, 2), (3, 7, 4, 2), (6, 6, 3, 1)])
def test_reference_matches_naive(seed, feature, T, S, H, KV):
    q, k, v = _inputs(2, T, S, H, KV, 4)
    o, lse = attention_reference(q, k, v, return_lse=True, **FEATURES[feature])
    o_n, lse_n = _naive(q, k, v, **FEATURES[feature])
    assert rel_err(o, o_n) < 1e-12, seed
    assert torch.allclose(lse.double(), lse_n, rtol=1e-6), seed


def test_reference_documents_and_masks_match_naive(seed):
    q, k, v = _inputs(2, 7, 7, 2, 1, 4)
    docs = torch.tensor([[0, 0, 1, 2, 2, 2, 3], [5, 6, 6, 6, 6, 7, 7]])  # documents of length 1 included
    o, lse = attention_reference(q, k, v, document_ids=docs, return_lse=True)
    o_n, lse_n = _naive(q, k, v, document_ids=docs)
    assert rel_err(o, o_n) < 1e-12, seed
    mask = torch.rand(2, 1, 7, 7) > 0.4
    mask[1, 0, 2] = False  # a row with nothing to attend to
    o, lse = attention_reference(q, k, v, causal=False, mask=mask, return_lse=True)
    o_n, lse_n = _naive(q, k, v, causal=False, mask=mask)
    assert rel_err(o, o_n) < 1e-12, seed
    assert torch.all(o[1, 2] == 0) and torch.isneginf(lse[1, :, 2]).all()
    additive = torch.randn(1, 2, 7, 7, dtype=torch.float64).masked_fill(torch.rand(1, 2, 7, 7) > 0.7, float("-inf"))
    o = attention_reference(q, k, v, causal=True, mask=additive)
    o_n, _ = _naive(q, k, v, causal=True, mask=additive)
    assert rel_err(o, o_n) < 1e-12, seed


GRAD_CASES = {
    "causal_gqa": dict(shape=(2, 5, 5, 4, 2), kw=dict(causal=True)),
    "full_mqa": dict(shape=(1, 4, 4, 3, 1), kw=dict(causal=False)),
    "decode_align": dict(shape=(1, 2, 6, 2, 2), kw=dict(causal=True)),
    "window": dict(shape=(1, 6, 6, 2, 1), kw=dict(causal=True, window=2)),
    "documents": dict(shape=(2, 6, 6, 2, 2), kw=dict(causal=True, document_ids=torch.tensor([[0, 1, 1, 1, 2, 2]] * 2))),
    "bool_mask_empty_row": dict(
        shape=(1, 4, 4, 2, 2),
        kw=dict(causal=False, mask=torch.tensor([[1, 0, 1, 1], [0, 0, 0, 0], [1, 1, 0, 1], [0, 1, 1, 1]]).bool()[None, None]),
    ),
}


@pytest.mark.parametrize("case", sorted(GRAD_CASES))
def test_reference_gradcheck_float64(seed, case):
    B, T, S, H, KV = GRAD_CASES[case]["shape"]
    kw = GRAD_CASES[case]["kw"]
    q, k, v = _inputs(B, T, S, H, KV, 3, grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v: attention_reference(q, k, v, **kw), (q, k, v)), seed


def test_reference_additive_mask_gradcheck(seed):
    q, k, v = _inputs(1, 4, 4, 2, 1, 3, grad=True)
    bias = torch.randn(1, 2, 4, 4, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda q, k, v: attention_reference(q, k, v, mask=bias), (q, k, v)), seed


def test_reference_empty_rows_have_zero_output_and_gradient(seed):
    q, k, v = _inputs(1, 3, 3, 1, 1, 4, grad=True)
    mask = torch.tensor([[True, False, True], [False, False, False], [True, True, True]])[None, None]
    o = attention_reference(q, k, v, causal=False, mask=mask)
    o.sum().backward()
    assert torch.all(o[0, 1] == 0)
    assert torch.isfinite(q.grad).all() and torch.all(q.grad[0, 1] == 0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("feature", sorted(FEATURES) + ["documents", "bool_mask", "additive_mask", "decode"])
def test_sdpa_matches_reference(seed, dtype, feature):
    B, T, S, H, KV, D = 2, 9, 9, 4, 2, 8
    kw = dict(FEATURES.get(feature, {}))
    if feature == "documents":
        kw = dict(causal=True, document_ids=_docs(B, T))
    elif feature == "bool_mask":
        mask = torch.rand(B, 1, T, S) > 0.5
        mask[0, 0, 4] = False  # an empty row: 0, not NaN
        kw = dict(causal=False, mask=mask)
    elif feature == "additive_mask":
        kw = dict(causal=True, mask=torch.randn(1, H, T, S, dtype=dtype))
    elif feature == "decode":
        T = 3
    q, k, v = _inputs(B, T, S, H, KV, D, dtype=dtype, grad=True)
    o = attention_sdpa(q, k, v, **kw)
    o.backward(torch.ones_like(o))
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    o_ref = attention_reference(q, k, v, **kw)
    o_ref.backward(torch.ones_like(o_ref))
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert rel_err(o, o_ref) < tol, seed
    for g, x in zip(grads, (q, k, v)):
        assert rel_err(g, x.grad) < tol * 10, seed


def test_sdpa_return_lse_is_the_reference(seed):
    q, k, v = _inputs(1, 4, 4, 2, 2, 8)
    o, lse = attention_sdpa(q, k, v, return_lse=True)
    o_ref, lse_ref = attention_reference(q, k, v, return_lse=True)
    assert rel_err(o, o_ref) < 1e-12 and rel_err(lse, lse_ref) < 1e-6


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("Tq", [1, 3])
def test_paged_reference_matches_dense(seed, block_size, Tq):
    B, H, KV, D = 3, 4, 2, 8
    lens = [Tq, 17, 9]  # one sequence holds only the new tokens
    max_blocks = max(-(-n // block_size) for n in lens)
    num_blocks = B * max_blocks + 2
    k_pool = torch.randn(num_blocks, block_size, KV, D, dtype=torch.float64)
    v_pool = torch.randn(num_blocks, block_size, KV, D, dtype=torch.float64)
    tables = torch.randperm(num_blocks)[: B * max_blocks].view(B, max_blocks).int()
    q = torch.randn(B, Tq, H, D, dtype=torch.float64)
    out = paged_attention_reference(q, k_pool, v_pool, tables, torch.tensor(lens, dtype=torch.int32), window=5)
    for b, n in enumerate(lens):
        # gather token by token from the definition: token t is at block tables[b, t // bs], slot t % bs
        k = torch.stack([k_pool[tables[b, t // block_size], t % block_size] for t in range(n)])[None]
        v = torch.stack([v_pool[tables[b, t // block_size], t % block_size] for t in range(n)])[None]
        ref = attention_reference(q[b : b + 1], k, v, causal=True, window=5)
        assert rel_err(out[b : b + 1], ref) < 1e-12, seed


def test_errors_name_the_argument():
    q, k, v = _inputs(1, 4, 4, 3, 2, 8)
    with pytest.raises(ValueError, match="multiple of the key/value heads"):
        attention_reference(q, k, v)
    q, k, v = _inputs(1, 5, 4, 2, 2, 8)
    with pytest.raises(ValueError, match="T <= S"):
        attention_reference(q, k, v)
    q, k, v = _inputs(1, 4, 4, 2, 2, 8)
    with pytest.raises(ValueError, match="`mask` has shape"):
        attention_reference(q, k, v, mask=torch.ones(1, 1, 4, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="`document_ids` has shape"):
        attention_reference(q, k, v, document_ids=torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="`window` must be >= 1"):
        attention_reference(q, k, v, window=0)
    with pytest.raises(ValueError, match="`v` has shape"):
        attention_reference(q, k, v[:, :3])
    with pytest.raises(ValueError, match="context_lens\\[0\\]=1 is smaller than Tq=2"):
        paged_attention_reference(
            torch.randn(1, 2, 2, 8), torch.randn(4, 4, 2, 8), torch.randn(4, 4, 2, 8),
            torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
        )
