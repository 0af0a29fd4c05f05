"""Distillation losses between a student and a teacher over one vocabulary, chunked over tokens.

Notation, per token: student logits ``z_s``, teacher logits ``z_t`` (both ``[V]``), temperature ``tau``,
``p = softmax(z_s / tau)`` (student), ``q = softmax(z_t / tau)`` (teacher). The losses (TRL's
``GKDTrainer.generalized_jsd_loss`` conventions, which follow Agarwal et al. 2024, "On-Policy
Distillation of Language Models: Learning from Self-Generated Mistakes", eq. 1):

- ``forward_kl``: ``KL(q || p) = sum q (log q - log p)`` (mean-seeking; classic KD, Hinton et al. 2015).
- ``reverse_kl``: ``KL(p || q) = sum p (log p - log q)`` (mode-seeking; MiniLLM).
- ``jsd``: generalised JSD with ``beta``: ``m = beta q + (1 - beta) p``,
  ``beta KL(q || m) + (1 - beta) KL(p || m)``. As in TRL, ``beta = 0`` is ``forward_kl`` and ``beta = 1``
  is ``reverse_kl`` (the limits of JSD(beta) / beta and / (1 - beta), which themselves vanish).
- ``topk``: forward KL on the teacher's ``top_k`` tokens only: ``q_k`` the teacher's top-k
  probabilities renormalised over those k (``softmax(z_t[K] / tau)``), ``sum_K q_k (log q_k - log p_k)``
  with ``p`` the student's full-vocabulary softmax (what sparse logit stores of a teacher allow).

Each token's divergence is averaged over the tokens that count (TRL's ``batchmean`` with labels); there is
no ``tau^2`` factor (TRL applies none either; scale the learning rate instead).

Chunking (the fused linear-cross-entropy style): ``distill_loss`` takes the final hidden states and the two
LM-head weights; tokens are processed ``chunk_size`` rows at a time, so only one ``[chunk, V]`` block of
each model's logits is alive. Two implementations:

- ``fused`` (default): a ``torch.autograd.Function`` whose forward also forms the gradient w.r.t. the
  student's logits of each chunk in closed form and accumulates ``d_hidden[c] = dz @ W_s`` and
  ``d_W_s += dz^T @ h[c]``; the backward only scales those by the incoming gradient. One pass of matmuls.
- ``checkpoint``: each chunk's loss under ``torch.utils.checkpoint`` (autograd's own gradient, the logits
  recomputed during the backward): the same memory bound, two passes of matmuls.

Closed-form gradients w.r.t. the student's scaled logits ``s = z_s / tau`` (then ``/ tau`` for ``z_s``);
``L`` is the token's divergence:

- forward KL (and top-k with ``q`` replaced by the renormalised top-k ``q`` scattered into ``[V]``): ``p - q``.
- reverse KL: ``p (log p - log q - L)``.
- JSD(beta): with ``g = (1 - beta)(log p - log m)`` (the derivative in ``p``; the ``q / m`` and ``p / m``
  terms cancel because ``m`` mixes them), through the softmax: ``p (g - sum p g)``.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = ["DISTILL_LOSSES", "DistillLossError", "check_distill_options", "distill_loss", "distill_loss_logits",
           "token_divergence"]

DistillLossName = Literal["forward_kl", "reverse_kl", "jsd", "topk"]
DISTILL_LOSSES: tuple[str, ...] = ("forward_kl", "reverse_kl", "jsd", "topk")


class DistillLossError(ValueError):
    """A distillation loss got options or tensors it cannot use; the message names the fix."""


def check_distill_options(loss: str, *, beta: float = 0.5, temperature: float = 1.0, top_k: int = 0,
                          vocab: int | None = None) -> None:
    """Raise ``DistillLossError`` for an unknown loss name or an option out of range.

    Args:
        loss: one of ``DISTILL_LOSSES``.
        beta: JSD interpolation, in [0, 1].
        temperature: softmax temperature, > 0.
        top_k: tokens kept of the teacher for ``topk`` (1 <= top_k <= vocab).
        vocab: the vocabulary size, when known (checks ``top_k``).
    """
    if loss not in DISTILL_LOSSES:
        raise DistillLossError(f"unknown distillation loss {loss!r}; choose one of {', '.join(DISTILL_LOSSES)}")
    if not 0.0 <= beta <= 1.0:
        raise DistillLossError(f"beta must be in [0, 1] (got {beta}); 0 is forward KL, 1 reverse KL")
    if not temperature > 0:
        raise DistillLossError(f"temperature must be > 0 (got {temperature})")
    if loss == "topk":
        if top_k < 1:
            raise DistillLossError(f"loss 'topk' needs top_k >= 1 (got {top_k}); set top_k, e.g. 64")
        if vocab is not None and top_k > vocab:
            raise DistillLossError(f"top_k {top_k} exceeds the vocabulary size {vocab}; use top_k <= {vocab} "
                                   "(or loss 'forward_kl' for the whole vocabulary)")


def _kind(loss: str, beta: float) -> str:
    """TRL's endpoints: JSD(0) is forward KL, JSD(1) reverse KL."""
    if loss == "jsd" and beta == 0.0:
        return "forward_kl"
    if loss == "jsd" and beta == 1.0:
        return "reverse_kl"
    return loss


def _teacher_logq(zt: torch.Tensor, kind: str, tau: float, top_k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The teacher's log-probs ``[C, V]`` (``-inf`` off the top-k for ``topk``) and the top-k mask."""
    if kind != "topk":
        return F.log_softmax(zt / tau, dim=-1), None
    vals, idx = zt.topk(top_k, dim=-1)  # (C, k)
    logq = torch.full_like(zt, float("-inf")).scatter_(1, idx, F.log_softmax(vals / tau, dim=-1))
    keep = torch.zeros_like(zt, dtype=torch.bool).scatter_(1, idx, True)
    return logq, keep


def token_divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor, *, loss: str = "forward_kl",
                     beta: float = 0.5, temperature: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """Per-row divergence ``[N]`` of materialised logits ``[N, V]`` (differentiable w.r.t. both).

    The naive reference (autograd through every op); ``distill_loss`` must equal its masked mean.
    """
    check_distill_options(loss, beta=beta, temperature=temperature, top_k=top_k, vocab=student_logits.shape[-1])
    kind = _kind(loss, beta)
    logp = F.log_softmax(student_logits / temperature, dim=-1)
    logq, keep = _teacher_logq(teacher_logits, kind, temperature, top_k)
    if kind in ("forward_kl", "topk"):
        diff = logq - logp
        if keep is not None:  # off the top-k q = 0 and log q = -inf: those terms are 0 by definition
            diff = torch.where(keep, diff, torch.zeros_like(diff))
        return (logq.exp() * diff).sum(-1)
    if kind == "reverse_kl":
        return (logp.exp() * (logp - logq)).sum(-1)
    b = torch.tensor(beta, dtype=logp.dtype, device=logp.device)
    logm = torch.logaddexp(logq + torch.log(b), logp + torch.log1p(-b))
    return b * (logq.exp() * (logq - logm)).sum(-1) + (1 - b) * (logp.exp() * (logp - logm)).sum(-1)


def distill_loss_logits(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor | None = None,
                        **options: Any) -> torch.Tensor:
    """Masked mean of ``token_divergence`` over materialised logits ``[..., V]`` (the naive version)."""
    V = student_logits.shape[-1]
    per = token_divergence(student_logits.reshape(-1, V), teacher_logits.reshape(-1, V), **options)  # (N,)
    if mask is None:
        return per.mean()
    m = mask.reshape(-1).to(per.dtype)
    return (per * m).sum() / m.sum().clamp(min=1)


def _chunk_terms(zs: torch.Tensor, zt: torch.Tensor, kind: str, beta: float, tau: float, top_k: int,
                 need_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-row divergence ``[C]`` and, if asked, its gradient w.r.t. the student's logits ``[C, V]``."""
    s = zs / tau
    logp = F.log_softmax(s, dim=-1)
    p = logp.exp()
    logq, keep = _teacher_logq(zt, kind, tau, top_k)
    q = logq.exp()  # exactly 0 off the top-k
    if kind in ("forward_kl", "topk"):
        diff = logq - logp
        if keep is not None:
            diff = torch.where(keep, diff, torch.zeros_like(diff))
        rows = (q * diff).sum(-1)
        grad = (p - q) if need_grad else None
    elif kind == "reverse_kl":
        rows = (p * (logp - logq)).sum(-1)
        grad = p * (logp - logq - rows[:, None]) if need_grad else None
    else:
        logm = torch.logaddexp(logq + torch.log(torch.tensor(beta, dtype=s.dtype, device=s.device)),
                               logp + torch.log1p(torch.tensor(-beta, dtype=s.dtype, device=s.device)))
        rows = beta * (q * (logq - logm)).sum(-1) + (1 - beta) * (p * (logp - logm)).sum(-1)
        if need_grad:
            g = (1 - beta) * (logp - logm)  # d/dp
            grad = p * (g - (p * g).sum(-1, keepdim=True))
        else:
            grad = None
    return rows, (grad / tau if grad is not None else None)


def _default_chunk(n: int, vocab: int, device: torch.device | None = None) -> int:
    """Rows per chunk so one ``[rows, V]`` block holds a budget of values (rows a power of two).

    The budget is 8M values on a CPU (64 rows at a 128k vocabulary) and 64M on a GPU (512 rows): on an H100 at
    8,192 tokens x 131,072 vocabulary (bf16, JSD) 64-row chunks ran 386 ms against the naive loss's 146 ms, since
    GEMMs that small leave it idle, while 512-row chunks ran 143 ms with 3.9 GiB extra instead of the naive 44 GiB
    (``bench/results/distill_memory.jsonl``).
    """
    budget_elements = 1 << 26 if device is not None and device.type == "cuda" else 1 << 23
    rows = max(1, budget_elements // max(vocab, 1))
    rows = 1 << (rows.bit_length() - 1)
    return max(1, min(rows, n))


class _FusedDistill(torch.autograd.Function):
    """Loss and student gradients in one chunked pass (see the module docstring for the formulas)."""

    @staticmethod
    def forward(ctx: Any, hs: torch.Tensor, ws: torch.Tensor, ht: torch.Tensor, wt: torch.Tensor, kind: str,
                beta: float, tau: float, top_k: int, chunk: int, track: bool) -> torch.Tensor:
        # matmuls run in the inputs' dtype (bf16 tensor cores accumulate in float32), the softmax algebra in
        # float32 (float64 for float64 inputs); the weight gradient accumulates across chunks in that precision
        compute = torch.promote_types(hs.dtype, torch.float32)
        n = hs.shape[0]
        # needs_input_grad says requires_grad even under no_grad (evaluation): ``track`` is the caller's grad mode
        need_h, need_w = track and ctx.needs_input_grad[0], track and ctx.needs_input_grad[1]
        total = torch.zeros((), dtype=compute, device=hs.device)
        d_h = torch.empty(hs.shape, dtype=compute, device=hs.device) if need_h else None
        d_w = torch.zeros(ws.shape, dtype=compute, device=hs.device) if need_w else None
        for start in range(0, n, chunk):
            sl = slice(start, start + chunk)
            h = hs[sl]
            zs = (h @ ws.T).to(compute)  # (chunk, V): the only student logits alive
            zt = (ht[sl] @ wt.T).to(compute)  # (chunk, V): the only teacher logits alive
            rows, dz = _chunk_terms(zs, zt, kind, beta, tau, top_k, need_h or need_w)
            total += rows.sum()
            del zs, zt
            if dz is not None:
                dz = (dz / max(n, 1)).to(hs.dtype)  # the mean over tokens; (chunk, V)
                if d_h is not None:
                    d_h[sl] = dz @ ws
                if d_w is not None:
                    d_w += dz.T @ h
            del dz
        ctx.save_for_backward(d_h, d_w)
        ctx.dtypes = (hs.dtype, ws.dtype)
        return total / max(n, 1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        d_h, d_w = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        # the loss is usually the graph's root (grad 1): hand the stored gradients over without another copy of
        # the [V, D] weight gradient (Liger's fused linear cross-entropy does the same)
        unit = bool(torch.equal(grad, torch.ones_like(grad)))
        out = []
        for stored, dtype in ((d_h, h_dtype), (d_w, w_dtype)):
            if stored is None:
                out.append(None)
            else:
                out.append((stored if unit else stored * grad.to(stored.dtype)).to(dtype))
        return out[0], out[1], None, None, None, None, None, None, None, None


def _chunk_sum(hs: torch.Tensor, ws: torch.Tensor, ht: torch.Tensor, wt: torch.Tensor, kind: str, beta: float,
               tau: float, top_k: int) -> torch.Tensor:
    compute = torch.promote_types(hs.dtype, torch.float32)
    zs = hs.to(compute) @ ws.to(compute).T  # (chunk, V)
    with torch.no_grad():
        zt = ht.to(compute) @ wt.to(compute).T  # (chunk, V)
    # autograd's own gradient: the naive per-row formula on this chunk
    return token_divergence(zs, zt, loss=kind, beta=beta, temperature=tau, top_k=top_k).sum()


def distill_loss(student_hidden: torch.Tensor, student_weight: torch.Tensor, teacher_hidden: torch.Tensor,
                 teacher_weight: torch.Tensor, *, loss: str = "forward_kl", beta: float = 0.5,
                 temperature: float = 1.0, top_k: int = 0, mask: torch.Tensor | None = None,
                 chunk_size: int | None = None, impl: Literal["fused", "checkpoint"] = "fused") -> torch.Tensor:
    """Mean per-token divergence between ``student_hidden @ student_weight.T`` and the teacher's logits.

    The teacher side carries no gradient (its hidden states and weight are read under no_grad).

    Args:
        student_hidden: ``[..., D_s]`` the student's final (normed) hidden states.
        student_weight: ``[V, D_s]`` the student's LM head.
        teacher_hidden: ``[..., D_t]`` the teacher's hidden states at the same positions.
        teacher_weight: ``[V, D_t]`` the teacher's LM head (same vocabulary).
        loss: ``forward_kl`` | ``reverse_kl`` | ``jsd`` | ``topk``.
        beta: JSD's interpolation (0: forward KL, 1: reverse KL, as TRL).
        temperature: softmax temperature of both models.
        top_k: teacher tokens kept by ``topk``.
        mask: ``[...]`` bool, the tokens that count (None: all).
        chunk_size: tokens per chunk (default: about 8M logits per chunk on CPU, 64M on GPU: 64 and 512
            tokens at a 128k vocabulary).
        impl: ``fused`` (closed-form gradients in one pass) | ``checkpoint`` (recompute per chunk).

    Returns:
        A 0-dim float32 (float64 for float64 inputs) tensor.

    Example:
        >>> loss = distill_loss(h_s, student.lm_head_weight, h_t, teacher.lm_head_weight, loss="jsd", beta=0.5,
        ...                     mask=targets != -100)
    """
    if student_weight.shape[0] != teacher_weight.shape[0]:
        raise DistillLossError(
            f"vocabulary mismatch: the student's LM head has {student_weight.shape[0]} rows and the teacher's "
            f"{teacher_weight.shape[0]}; distil between models that share a tokenizer and vocabulary size "
            "(resize the student's embeddings to the teacher's vocabulary)")
    check_distill_options(loss, beta=beta, temperature=temperature, top_k=top_k, vocab=student_weight.shape[0])
    if student_hidden.shape[:-1] != teacher_hidden.shape[:-1]:
        raise DistillLossError(f"student hidden {tuple(student_hidden.shape)} and teacher hidden "
                               f"{tuple(teacher_hidden.shape)} cover different tokens; run both on the same ids")
    if student_hidden.shape[-1] != student_weight.shape[1] or teacher_hidden.shape[-1] != teacher_weight.shape[1]:
        raise DistillLossError("hidden size and LM-head width differ (student "
                               f"{student_hidden.shape[-1]} vs {student_weight.shape[1]}, teacher "
                               f"{teacher_hidden.shape[-1]} vs {teacher_weight.shape[1]}); pass lm_head_weight [V, D]")
    hs = student_hidden.reshape(-1, student_hidden.shape[-1])  # (N, D_s)
    ht = teacher_hidden.detach().reshape(-1, teacher_hidden.shape[-1])  # (N, D_t)
    wt = teacher_weight.detach()
    if mask is not None:
        keep = mask.reshape(-1).to(hs.device).bool()
        hs, ht = hs[keep], ht[keep]  # only the tokens that count enter the chunks
    kind = _kind(loss, beta)
    n = hs.shape[0]
    if n == 0:
        return (hs.sum() * 0.0 + student_weight.sum() * 0.0).float()
    chunk = chunk_size or _default_chunk(n, student_weight.shape[0], hs.device)
    if impl == "fused":
        return _FusedDistill.apply(hs, student_weight, ht, wt, kind, float(beta), float(temperature), int(top_k),
                                   int(chunk), torch.is_grad_enabled())
    if impl != "checkpoint":
        raise DistillLossError(f"unknown impl {impl!r}; choose fused or checkpoint")
    total = None
    for start in range(0, n, chunk):
        sl = slice(start, start + chunk)
        part = checkpoint(_chunk_sum, hs[sl], student_weight, ht[sl], wt, kind, float(beta), float(temperature),
                          int(top_k), use_reentrant=False)
        total = part if total is None else total + part
    assert total is not None
    return total / n
