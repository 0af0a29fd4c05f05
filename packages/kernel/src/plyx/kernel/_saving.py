"""Forwards that return what their backward needs, and those backwards: the custom ops' autograd without recompute.

A ``plyx::<name>`` custom op (``_custom_ops``) cannot keep an implementation's autograd graph across the
traced graph's forward/backward split: only tensors flow between them. So each op's forward returns its
outputs **and** a fixed set of extra tensors (its *saved* statistics, declared in the op's schema and fake
implementation), and its backward computes the gradients from those, never re-running the forward:

=====================  ============================================  ========================================
op                     extra outputs of the forward                  backward
=====================  ============================================  ========================================
rmsnorm(+residual)     rstd ``x.shape[:-1]`` (float32; f64 for f64)  Triton ``backward_saved``, else closed form
swiglu                 none (the inputs suffice)                     Triton ``swiglu_backward``, else closed form
rope, rope_qk          none                                          the same op with ``-sin`` (the inverse
                                                                     rotation: the contract's transpose)
attention              lse ``[B, H, T]`` (float32; f64 for f64)      Triton flash backward from (o, lse2);
                                                                     reference: closed form from (o, lse)
cross_entropy          lse ``[N]`` (float32; f64 for f64)            one pass over the logits: Triton
                                                                     ``cross_entropy_backward``, else closed form
linear_cross_entropy   d_hidden, d_weight, d_bias for a gradient 1   each times ``grad``
=====================  ============================================  ========================================

The fused linear cross-entropy follows its Triton kernel's design (the gradient is computed in the forward
pass, as the eager call does): for any implementation, the forward runs it with autograd and differentiates
at once.

Which implementation runs is still the registry's choice at run time (inside the op). The backward selects
again for the same inputs; an implementation without a saving forward here (a third-party kernel, the
``sdpa`` attention) falls back to re-running its forward with autograd in the backward (the extras are then
placeholders), as does ``linear_cross_entropy(reduction="none")``, whose per-row factors arrive only in the
backward. ``FORWARD_RUNS`` counts the implementations' forward runs per op, recomputes included (tests assert
one per forward+backward).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

__all__ = ["FORWARD_RUNS", "EXTRAS", "N_EXTRAS", "SAVED_OUTPUTS", "Split", "dropped_inputs", "grad_fakes", "select", "split_for"]

#: op name -> implementations' forward runs (the saving forward and any recompute in a backward)
FORWARD_RUNS: Counter[str] = Counter()


class Split(NamedTuple):
    """``forward(args) -> (outputs, extras)`` and ``backward(grads, outputs, extras, args) -> gradients of the
    op's differentiable arguments`` (None where absent), or ``backward`` None: recompute in the backward."""

    forward: Callable[..., tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]
    backward: Callable[..., list[torch.Tensor | None]] | None


def select(name: str, *tensors: torch.Tensor, **shape: int) -> Callable[..., Any]:
    from plyx.kernel._default import registry

    return registry().get(name, *tensors, **shape)


def _stat_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


# -- fake extras: shapes and dtypes of each op's extra outputs (the op's fake implementation appends them) --

def _no_extras(*_: Any) -> tuple[torch.Tensor, ...]:
    return ()


def _ce_extras(logits: torch.Tensor, targets: torch.Tensor, ii: int, ls: float, zl: float,
               red: str) -> tuple[torch.Tensor, ...]:
    return (logits.new_empty(logits.shape[:1], dtype=_stat_dtype(logits)),)  # lse [N]


def _lce_saves(reduction: str, grad: bool) -> bool:
    return grad and reduction != "none"


def _lce_extras(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, bias: torch.Tensor | None,
                ii: int, ls: float, zl: float, red: str, grad: bool) -> tuple[torch.Tensor, ...]:
    if not _lce_saves(red, grad):
        return hidden.new_empty(0), weight.new_empty(0), hidden.new_empty(0)
    return (torch.empty_like(hidden), torch.empty_like(weight),
            torch.empty_like(bias) if bias is not None else hidden.new_empty(0))


#: op name -> how many extra outputs its forward returns (after the op's own outputs)
N_EXTRAS: dict[str, int] = {"rmsnorm": 1, "rmsnorm_residual": 1, "swiglu": 0, "rope": 0, "rope_qk": 0, "attention": 1,
                            "cross_entropy": 1, "linear_cross_entropy": 3}

#: op name -> positions of the op's outputs its backward reads (saved besides the extras)
SAVED_OUTPUTS: dict[str, tuple[int, ...]] = {"rmsnorm_residual": (1,), "attention": (0,)}


def dropped_inputs(op: str, args: Sequence[Any]) -> tuple[int, ...]:
    """Positions of tensor arguments the backward does not read, so not saved for it.

    As the eager Triton Functions save them: RMSNorm with a residual keeps its output h (not x and residual),
    RoPE only its tables, the fused loss its gradients (not its hidden states); each would otherwise hold a
    ``[B, T, D]``-sized tensor per layer until the backward.
    """
    if op == "rmsnorm_residual":
        return (0, 2)
    if op == "rope":
        return (0,)
    if op == "rope_qk":
        return (0, 1)
    if op == "linear_cross_entropy" and _lce_saves(args[7], args[8]):
        return (0, 2)
    return ()


def grad_fakes(op: str, grads: Sequence[torch.Tensor], saved: Sequence[torch.Tensor],
               args: Sequence[Any]) -> list[torch.Tensor] | None:
    """The backward's fake gradients where an input was dropped: shaped like the incoming gradients of the
    outputs of the same shape, or the saved gradient extras."""
    if op == "rmsnorm_residual":
        return [torch.empty_like(grads[0]), torch.empty_like(args[1]), torch.empty_like(grads[0])]
    if op in ("rope", "rope_qk"):
        return [torch.empty_like(g) for g in grads]
    if op == "linear_cross_entropy" and _lce_saves(args[7], args[8]):
        return [torch.empty_like(t) for t in saved[-3:]]
    return None


#: op name -> the fake extra outputs for the op's arguments
EXTRAS: dict[str, Callable[..., tuple[torch.Tensor, ...]]] = {
    "rmsnorm": lambda x, w, eps: (x.new_empty(x.shape[:-1], dtype=_stat_dtype(x)),),
    "rmsnorm_residual": lambda x, w, r, eps: (x.new_empty(x.shape[:-1], dtype=_stat_dtype(x)),),
    "swiglu": _no_extras,
    "rope": _no_extras,
    "rope_qk": _no_extras,
    # lse [B, H, T]: q's batch, heads and tokens
    "attention": lambda q, *_: (q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=_stat_dtype(q)),),
    "cross_entropy": _ce_extras,
    "linear_cross_entropy": _lce_extras,
}


# -- rmsnorm ------------------------------------------------------------------------------------------

def _rmsnorm_generic_forward(fn: Callable[..., Any], x: torch.Tensor, w: torch.Tensor, r: torch.Tensor | None,
                             eps: float) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    out = fn(x, w, eps=eps) if r is None else fn(x, w, eps=eps, residual=r)
    h = x if r is None else out[1]
    hc = h.to(_stat_dtype(h))
    rstd = torch.rsqrt(hc.square().mean(-1) + eps)  # [...]: the statistics of the rounded stream
    return (out,) if r is None else tuple(out), (rstd,)


def _rmsnorm_closed_backward(dy: torch.Tensor, dh_out: torch.Tensor | None, h: torch.Tensor, w: torch.Tensor,
                             rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dh, dw)`` with xhat = h * rstd, g = dy * w: ``dh = rstd (g - xhat mean(g xhat)) (+ dh_out)``,
    ``dw = sum_rows dy xhat`` (the reference's formula, float32 or float64)."""
    c = rstd.dtype
    r = rstd[..., None]
    xhat = h.to(c) * r
    g = dy.to(c) * w.to(c)
    dh = r * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    if dh_out is not None:
        dh = dh + dh_out.to(c)
    dw = (dy.to(c) * xhat).reshape(-1, h.shape[-1]).sum(0)
    return dh.to(h.dtype), dw.to(w.dtype)


def _rmsnorm_split(fn: Callable[..., Any], residual: bool) -> Split:
    triton = _is_triton("rmsnorm", fn)

    def forward(x: torch.Tensor, w: torch.Tensor, *rest: Any) -> Any:
        r, eps = (rest[0], rest[1]) if residual else (None, rest[0])
        if triton:
            from plyx.kernel.triton_ops.rmsnorm import forward_saving

            y, h, rstd = forward_saving(x, w, r, eps)
            return ((y,) if r is None else (y, h)), (rstd.view(x.shape[:-1]),)
        return _rmsnorm_generic_forward(fn, x, w, r, eps)

    def backward(grads: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], extras: Sequence[torch.Tensor],
                 args: Sequence[Any]) -> list[torch.Tensor | None]:
        w = args[1]
        h = outs[0] if residual else args[0]  # the op's returned h (SAVED_OUTPUTS); x and residual are not saved
        dy, dh_out = grads[0], (grads[1] if residual else None)
        (rstd,) = extras
        if triton:
            from plyx.kernel.triton_ops.rmsnorm import backward_saved

            h2 = h.reshape(-1, h.shape[-1])  # [N, D]
            if h2.stride(-1) != 1:
                h2 = h2.contiguous()
            dh, dw = backward_saved(dy, dh_out, h2, w if w.is_contiguous() else w.contiguous(), rstd.reshape(-1))
            dh = dh.view(h.shape)
        else:
            dh, dw = _rmsnorm_closed_backward(dy, dh_out, h, w, rstd)
        # x and residual get the same gradient (the op's outputs never alias: copied by the caller)
        return [dh, dw, dh] if residual else [dh, dw]

    return Split(forward, backward)


# -- swiglu -------------------------------------------------------------------------------------------

def _swiglu_split(fn: Callable[..., Any]) -> Split:
    triton = _is_triton("swiglu", fn)

    def forward(gate: torch.Tensor, up: torch.Tensor) -> Any:
        return (fn(gate, up),), ()

    def backward(grads: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], extras: Sequence[torch.Tensor],
                 args: Sequence[Any]) -> list[torch.Tensor | None]:
        gate, up = args
        dy = grads[0]
        if triton:
            from plyx.kernel.triton_ops.swiglu import swiglu_backward

            return list(swiglu_backward(dy, gate, up))
        c = torch.promote_types(gate.dtype, torch.float32)
        g, u, d = gate.to(c), up.to(c), dy.to(c)
        s = torch.sigmoid(g)
        return [(d * u * s * (1 + g * (1 - s))).to(gate.dtype), (d * g * s).to(up.dtype)]

    return Split(forward, backward)


# -- rope, rope_qk: the backward is the same rotation by -angle, through whatever implementation ----------

def _rope_split(fn: Callable[..., Any], name: str) -> Split:
    def forward(*args: Any) -> Any:
        *tensors, cos, sin, interleaved = args
        out = fn(*tensors, cos, sin, interleaved=interleaved)
        return (out if isinstance(out, tuple) else (out,)), ()

    def backward(grads: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], extras: Sequence[torch.Tensor],
                 args: Sequence[Any]) -> list[torch.Tensor | None]:
        *_, cos, sin, interleaved = args
        grads = [g.contiguous() for g in grads]
        inverse = select(name, *grads, cos, sin, head_dim=int(grads[0].shape[-1]))
        got = inverse(*grads, cos, -sin, interleaved=interleaved)
        return list(got) if isinstance(got, tuple) else [got]

    return Split(forward, backward)


# -- attention ----------------------------------------------------------------------------------------

def _attention_split(fn: Callable[..., Any]) -> Split | None:
    from plyx.kernel import attention as attn

    # hybrid: the custom op only sees its non-SDPA calls under compile (plain causal ones trace SDPA instead);
    # any call it gets runs the Triton kernel, the same contract, with its saved lse
    if fn is attn.attention_triton or fn is attn.attention_hybrid:
        from plyx.kernel.attention._flash import flash_attention_backward as bwd
        from plyx.kernel.attention._flash import flash_attention_saving as fwd
    elif fn is attn.attention_reference:
        from plyx.kernel.attention._reference import attention_reference_backward as bwd
        from plyx.kernel.attention._reference import attention_reference_saving as fwd
    else:
        return None

    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                docs: torch.Tensor | None, causal: bool, scale: float | None, window: int | None) -> Any:
        o, lse = fwd(q, k, v, causal=causal, scale=scale, mask=mask, document_ids=docs, window=window)
        return (o,), (lse,)

    def backward(grads: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], extras: Sequence[torch.Tensor],
                 args: Sequence[Any]) -> list[torch.Tensor | None]:
        q, k, v, mask, docs, causal, scale, window = args
        dq, dk, dv = bwd(grads[0], q, k, v, outs[0], extras[0], causal=causal, scale=scale, mask=mask,
                         document_ids=docs, window=window)
        return [dq, dk, dv]

    return Split(forward, backward)


def _attention_placeholder(fn: Callable[..., Any]) -> Split:
    """An implementation without saved statistics (``sdpa``, third-party): its output and an unused lse."""

    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                docs: torch.Tensor | None, causal: bool, scale: float | None, window: int | None) -> Any:
        o = fn(q, k, v, causal=causal, scale=scale, mask=mask, document_ids=docs, window=window)
        return (o,), tuple(t.zero_() for t in EXTRAS["attention"](q))  # defined values: outputs are compared

    return Split(forward, None)


# -- the fused linear cross-entropy: gradients computed in the forward pass ---------------------------------

def _scale(d: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``d * grad`` in d's dtype: a scalar grad scales all, a per-row grad ``[N]`` scales rows."""
    g = grad.to(d.dtype)
    return d * (g[:, None] if g.dim() else g)


def _autograd_grads(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any],
                    wrt: Sequence[int]) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """``(loss, gradients)``: ``fn`` run with autograd and differentiated at once for an incoming gradient of 1."""
    from plyx.kernel._custom_ops import _with_autograd

    with _with_autograd(), torch.enable_grad():
        leaves = list(args)
        for i in wrt:
            if isinstance(args[i], torch.Tensor):
                leaves[i] = args[i].detach().requires_grad_(True)
        loss = fn(*leaves, **kwargs)
        inputs = [leaves[i] for i in wrt if isinstance(leaves[i], torch.Tensor)]
        got = iter(torch.autograd.grad(loss, inputs, torch.ones_like(loss), materialize_grads=True))
    grads = [next(got) if isinstance(args[i], torch.Tensor) else None for i in wrt]
    return loss.detach(), grads


def _ce_closed_backward(grad: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                        ii: int, ls: float, zl: float, red: str) -> torch.Tensor:
    """The contract's gradient (``reference.cross_entropy``'s docstring) from the saved lse, in torch::

        dz[j] = g_i * s * (softmax(z)[j] * (1 + 2 z_loss lse) - (1 - eps) [j == t] - eps / V)

    with s = 1/n_valid (mean) or 1, 0 on ignored rows."""
    c = lse.dtype
    z = logits.to(c)
    valid = targets != ii
    scale = valid.to(c) * (grad.to(c) if grad.dim() else grad.to(c).expand(valid.shape))
    if red == "mean":
        scale = scale / valid.sum().clamp(min=1).to(c)
    dz = torch.exp(z - lse[:, None]) * (1.0 + 2.0 * zl * lse[:, None]) - ls / z.shape[-1]
    safe = torch.where(valid, targets, torch.zeros_like(targets)).long()
    dz.scatter_add_(1, safe[:, None], torch.full_like(dz[:, :1], -(1.0 - ls)))
    return (dz * scale[:, None]).to(logits.dtype)


def _ce_split(fn: Callable[..., Any]) -> Split:
    triton = _is_triton("cross_entropy", fn)

    def forward(logits: torch.Tensor, targets: torch.Tensor, ii: int, ls: float, zl: float, red: str) -> Any:
        options = dict(ignore_index=ii, label_smoothing=ls, z_loss=zl, reduction=red)
        if triton:
            from plyx.kernel.triton_ops.cross_entropy import cross_entropy_saving

            loss, lse = cross_entropy_saving(logits, targets, **options)
            return (loss,), (lse,)
        loss = fn(logits, targets, **options)
        return (loss,), (torch.logsumexp(logits.to(_stat_dtype(logits)), dim=-1),)

    def backward(grads: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], extras: Sequence[torch.Tensor],
                 args: Sequence[Any]) -> list[torch.Tensor | None]:
        logits, targets, ii, ls, zl, red = args
        if triton:
            from plyx.kernel.triton_ops.cross_entropy import cross_entropy_backward

            return [cross_entropy_backward(grads[0], logits, targets, extras[0], ignore_index=ii,
                                           label_smoothing=ls, z_loss=zl, reduction=red)]
        return [_ce_closed_backward(grads[0], logits, targets, extras[0], ii, ls, zl, red)]

    return Split(forward, backward)


def _lce_split(fn: Callable[..., Any]) -> Split:
    triton = _is_triton("linear_cross_entropy", fn)

    def forward(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, bias: torch.Tensor | None,
                ii: int, ls: float, zl: float, red: str, grad: bool) -> Any:
        options = dict(ignore_index=ii, label_smoothing=ls, z_loss=zl, reduction=red)
        if not _lce_saves(red, grad):
            loss = fn(hidden, weight, targets, bias=bias, **options)
            return (loss,), _lce_extras(hidden, weight, targets, bias, ii, ls, zl, red, grad)
        if triton:
            from plyx.kernel.triton_ops.linear_cross_entropy import linear_cross_entropy_with_grads

            loss, dh, dw, db = linear_cross_entropy_with_grads(hidden, weight, targets, bias=bias, **options)
        else:
            def call(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, b: torch.Tensor | None, **kw: Any) -> Any:
                return fn(h, w, t, bias=b, **kw)

            loss, (dh, dw, db) = _autograd_grads(call, (hidden, weight, targets, bias), options, (0, 1, 3))
        assert dh is not None and dw is not None
        return (loss,), (dh, dw, db if db is not None else hidden.new_empty(0))

    def backward(grads: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], extras: Sequence[torch.Tensor],
                 args: Sequence[Any]) -> list[torch.Tensor | None]:
        g = grads[0]
        dh, dw, db = extras
        return [_scale(dh, g), _scale(dw, g), _scale(db, g) if args[3] is not None else None]

    def backward_or_recompute(grads: Sequence[torch.Tensor], outs: Sequence[torch.Tensor],
                              extras: Sequence[torch.Tensor], args: Sequence[Any]) -> list[torch.Tensor | None] | None:
        return backward(grads, outs, extras, args) if _lce_saves(args[7], args[8]) else None

    return Split(forward, backward_or_recompute)


# -- the table -----------------------------------------------------------------------------------------

def _is_triton(name: str, fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` is the built-in Triton implementation of ``name`` (the lazily imported callable)."""
    from plyx.kernel.triton_ops._registration import _LAZY

    return _LAZY.get((name, name)) is fn


def split_for(op: str, fn: Callable[..., Any]) -> Split:
    """The saving forward and the backward of op ``op`` when the registry chose ``fn``.

    ``Split.backward`` None (or returning None) means: re-run the forward with autograd in the backward.
    """
    if op in ("rmsnorm", "rmsnorm_residual"):
        return _rmsnorm_split(fn, op == "rmsnorm_residual")
    if op == "swiglu":
        return _swiglu_split(fn)
    if op in ("rope", "rope_qk"):
        return _rope_split(fn, op)
    if op == "attention":
        return _attention_split(fn) or _attention_placeholder(fn)
    if op == "cross_entropy":
        return _ce_split(fn)
    if op == "linear_cross_entropy":
        return _lce_split(fn)
    raise KeyError(op)
