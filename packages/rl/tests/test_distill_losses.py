"""Distillation losses: the naive version vs TRL's ``generalized_jsd_loss`` (oracle), the chunked versions
(fused closed-form gradients and per-chunk checkpointing) vs the naive one in float64 (values and gradients)
over shapes, chunk sizes and dtypes, top-k against its formula, and the bad-input errors."""

from __future__ import annotations

import math

import pytest
import torch
from plyx.rl._distill import (
    DISTILL_LOSSES,
    DistillLossError,
    distill_loss,
    distill_loss_logits,
    token_divergence,
)

CASES = [("forward_kl", {}), ("reverse_kl", {}), ("jsd", {"beta": 0.5}), ("jsd", {"beta": 0.1}),
         ("jsd", {"beta": 0.0}), ("jsd", {"beta": 1.0}), ("topk", {"top_k": 3}), ("topk", {"top_k": 1})]


def _inputs(n: int, vocab: int, ds: int, dt: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(n, ds, generator=g, dtype=torch.float64)
    ws = torch.randn(vocab, ds, generator=g, dtype=torch.float64) / math.sqrt(ds) * 2
    ht = torch.randn(n, dt, generator=g, dtype=torch.float64)
    wt = torch.randn(vocab, dt, generator=g, dtype=torch.float64) / math.sqrt(dt) * 2
    mask = torch.rand(n, generator=g) > 0.3
    mask[0] = True
    return tuple(t.to(dtype) for t in (hs, ws, ht, wt)) + (mask,)


def _naive(hs, ws, ht, wt, mask, **options):
    """Materialised logits, autograd through every op, in float64."""
    hs = hs.detach().double().requires_grad_()
    ws = ws.detach().double().requires_grad_()
    zs, zt = hs @ ws.T, ht.double() @ wt.double().T  # (N, V)
    loss = distill_loss_logits(zs, zt, mask, **options)
    loss.backward()
    return loss.detach(), hs.grad, ws.grad


# -- the oracle: TRL's generalized_jsd_loss --------------------------------------------------------------------
@pytest.mark.parametrize("beta", [0.0, 0.25, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_naive_loss_matches_trl_generalized_jsd(beta, temperature):
    pytest.importorskip("trl")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl.experimental.gkd import GKDTrainer

    g = torch.Generator().manual_seed(3)
    B, T, V = 2, 5, 11
    zs = (torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2).requires_grad_()
    zt = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, :2] = -100
    labels[1, 4] = -100
    expected = GKDTrainer.generalized_jsd_loss(zs, zt, labels=labels, beta=beta, temperature=temperature)
    (g_expected,) = torch.autograd.grad(expected, zs)
    loss = "jsd" if 0 < beta < 1 else ("forward_kl" if beta == 0 else "reverse_kl")
    ours = distill_loss_logits(zs, zt, labels != -100, loss=loss, beta=beta, temperature=temperature)
    (g_ours,) = torch.autograd.grad(ours, zs)
    torch.testing.assert_close(ours, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(g_ours, g_expected, rtol=1e-9, atol=1e-12)
    # and "jsd" with the endpoint betas is TRL's endpoint behaviour too
    jsd = distill_loss_logits(zs, zt, labels != -100, loss="jsd", beta=beta, temperature=temperature)
    torch.testing.assert_close(jsd, expected, rtol=1e-10, atol=1e-12)


def test_topk_matches_its_formula_and_full_k_is_forward_kl():
    g = torch.Generator().manual_seed(5)
    zs, zt = torch.randn(6, 9, generator=g, dtype=torch.float64), torch.randn(6, 9, generator=g, dtype=torch.float64)
    tau, k = 1.5, 4
    ours = token_divergence(zs, zt, loss="topk", top_k=k, temperature=tau)
    for row in range(6):
        idx = zt[row].topk(k).indices.tolist()
        q = torch.softmax(zt[row, idx] / tau, dim=0)  # renormalised over the k
        logp = torch.log_softmax(zs[row] / tau, dim=0)[idx]  # the student's full-vocabulary log-probs
        want = sum(float(q[i]) * (math.log(float(q[i])) - float(logp[i])) for i in range(k))
        assert float(ours[row]) == pytest.approx(want, rel=1e-12)
    full = token_divergence(zs, zt, loss="topk", top_k=9, temperature=tau)
    torch.testing.assert_close(full, token_divergence(zs, zt, loss="forward_kl", temperature=tau))
    assert (token_divergence(zs, zt, loss="reverse_kl") >= 0).all()
    assert float(token_divergence(zs, zs, loss="jsd", beta=0.3).abs().max()) < 1e-12  # zero at p = q


# -- chunked vs naive, float64 --------------------------------------------------------------------------------
@pytest.mark.parametrize("loss,options", CASES)
@pytest.mark.parametrize("shape", [(1, 7, 5, 3), (37, 341, 16, 24), (9, 41, 8, 8)])
@pytest.mark.parametrize("impl,chunk", [("fused", 1), ("fused", 5), ("fused", None), ("checkpoint", 4)])
def test_chunked_equals_naive_float64(loss, options, shape, impl, chunk):
    hs, ws, ht, wt, mask = _inputs(*shape, torch.float64, seed=sum(shape))
    want, want_gh, want_gw = _naive(hs, ws, ht, wt, mask, loss=loss, temperature=1.3, **options)
    hs, ws = hs.clone().requires_grad_(), ws.clone().requires_grad_()
    got = distill_loss(hs, ws, ht, wt, loss=loss, temperature=1.3, mask=mask, chunk_size=chunk, impl=impl, **options)
    (got * 2.5).backward()  # a non-unit incoming gradient: the backward scales the stored gradients
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(hs.grad, 2.5 * want_gh, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(ws.grad, 2.5 * want_gw, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("loss,options", [("reverse_kl", {}), ("jsd", {"beta": 0.4}), ("topk", {"top_k": 2})])
def test_fused_passes_gradcheck(loss, options):
    hs, ws, ht, wt, mask = _inputs(4, 6, 3, 2, torch.float64, seed=11)
    hs.requires_grad_()
    ws.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda a, b: distill_loss(a, b, ht, wt, loss=loss, mask=mask, chunk_size=3, **options), (hs, ws))


# each dtype's tolerance: float32 keeps ~1e-6 relative over V terms; bf16: the reference starts from the same
# bf16-rounded inputs, but the logits themselves come out of a bf16 matmul (8 bits of mantissa) and the
# gradients go back through one. topk is float32 only: bf16-rounded teacher logits reorder near-ties, so the
# top-k set itself may differ from the float64 one (a different, equally valid, loss)
@pytest.mark.parametrize("dtype,tol,loss,options", [
    (torch.float32, 1e-5, "forward_kl", {}), (torch.float32, 1e-5, "jsd", {"beta": 0.5}),
    (torch.float32, 1e-5, "topk", {"top_k": 8}), (torch.float32, 1e-5, "reverse_kl", {}),
    (torch.bfloat16, 2e-2, "forward_kl", {}), (torch.bfloat16, 2e-2, "jsd", {"beta": 0.5}),
    (torch.bfloat16, 2e-2, "reverse_kl", {})])
def test_chunked_low_precision_inputs_against_float64(dtype, tol, loss, options):
    hs, ws, ht, wt, mask = _inputs(33, 257, 16, 32, dtype, seed=2)
    want, want_gh, want_gw = _naive(hs, ws, ht, wt, mask, loss=loss, **options)
    hs, ws = hs.clone().requires_grad_(), ws.clone().requires_grad_()
    got = distill_loss(hs, ws, ht, wt, loss=loss, mask=mask, chunk_size=8, **options)
    got.backward()
    assert got.dtype == torch.float32 and hs.grad.dtype == dtype and ws.grad.dtype == dtype
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * 1e-2)
    torch.testing.assert_close(hs.grad.double(), want_gh, rtol=tol, atol=tol * float(want_gh.abs().max()))
    torch.testing.assert_close(ws.grad.double(), want_gw, rtol=tol, atol=tol * float(want_gw.abs().max()))


def test_no_gradient_pass_and_empty_mask(monkeypatch):
    import plyx.rl._distill as mod

    hs, ws, ht, wt, mask = _inputs(10, 20, 4, 4, torch.float32)
    ws.requires_grad_()
    asked = []
    real = mod._chunk_terms
    monkeypatch.setattr(mod, "_chunk_terms", lambda *a: asked.append(a[-1]) or real(*a))
    with torch.no_grad():  # evaluation: no gradient is formed although ws requires one
        a = distill_loss(hs, ws, ht, wt, loss="jsd", chunk_size=3)
    assert asked == [False] * 4
    torch.testing.assert_close(a, distill_loss_logits(hs @ ws.T, ht @ wt.T, loss="jsd").detach())
    zero = distill_loss(hs, ws, ht, wt, mask=torch.zeros(10, dtype=torch.bool))
    zero.backward()
    assert float(zero.detach()) == 0.0 and float(ws.grad.abs().sum()) == 0.0


# -- bad input ---------------------------------------------------------------------------------------------
def test_bad_inputs_are_named():
    hs, ws, ht, wt, _ = _inputs(4, 10, 4, 6, torch.float32)
    with pytest.raises(DistillLossError, match="unknown distillation loss 'kl'.*forward_kl, reverse_kl, jsd, topk"):
        distill_loss(hs, ws, ht, wt, loss="kl")
    with pytest.raises(DistillLossError, match="vocabulary mismatch.*10 rows.*12.*share a tokenizer"):
        distill_loss(hs, ws, ht, torch.randn(12, 6))
    with pytest.raises(DistillLossError, match="top_k 11 exceeds the vocabulary size 10"):
        distill_loss(hs, ws, ht, wt, loss="topk", top_k=11)
    with pytest.raises(DistillLossError, match="needs top_k >= 1"):
        distill_loss(hs, ws, ht, wt, loss="topk")
    with pytest.raises(DistillLossError, match="beta must be in"):
        distill_loss(hs, ws, ht, wt, loss="jsd", beta=1.5)
    with pytest.raises(DistillLossError, match="different tokens"):
        distill_loss(hs, ws, ht[:3], wt)
    assert set(DISTILL_LOSSES) == {"forward_kl", "reverse_kl", "jsd", "topk"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("loss,options", [("forward_kl", {}), ("jsd", {"beta": 0.5}), ("reverse_kl", {})])
def test_cuda_bf16_fused_against_float64(loss, options):
    hs, ws, ht, wt, mask = _inputs(300, 4099, 64, 96, torch.bfloat16, seed=9)
    want, want_gh, want_gw = _naive(hs, ws, ht, wt, mask, loss=loss, **options)
    hs, ws = hs.cuda().requires_grad_(), ws.cuda().requires_grad_()
    got = distill_loss(hs, ws, ht.cuda(), wt.cuda(), loss=loss, mask=mask.cuda(), chunk_size=64, **options)
    got.backward()
    tol = 2e-2  # bf16 matmuls, as in the CPU bf16 test
    torch.testing.assert_close(got.double().cpu(), want, rtol=tol, atol=tol * 1e-2)
    torch.testing.assert_close(hs.grad.double().cpu(), want_gh, rtol=tol, atol=tol * float(want_gh.abs().max()))
    torch.testing.assert_close(ws.grad.double().cpu(), want_gw, rtol=tol, atol=tol * float(want_gw.abs().max()))
