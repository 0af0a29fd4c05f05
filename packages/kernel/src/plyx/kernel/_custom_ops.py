"""The training kernels as ``torch.library`` custom ops, so ``torch.compile`` treats them as opaque ops.

Under ``torch.compile`` Dynamo would otherwise trace into the registry's chosen implementation: into
the registry's caches (graph breaks) and, for Triton kernels, into the kernels themselves, where
Inductor's mutation analysis fails on inline PTX (the 1B run's ``tt.elementwise_inline_asm``
InductorError). A custom op is one node of known output shape (its fake implementation), run eagerly
by the compiled graph, whatever implementation the registry picks at run time.

Each op ``plyx::<name>`` has:

- a forward that asks the default registry for the implementation (device, dtype, sizes) and calls it
  without autograd (the output never aliases an input: a view is copied);
- a fake implementation that allocates outputs of the right shape and dtype (``opcheck``-tested);
- an autograd formula (``register_autograd``) that calls a second op ``plyx::<name>_backward``,
  itself opaque: it re-runs the chosen implementation's forward with autograd on and differentiates
  it (``torch.autograd.grad``). The forward saves only its inputs, never the implementation's
  intermediate state (which a custom op cannot return through a traced graph without widening its
  schema), so the backward pays one more forward of the op: ~1/3 of an elementwise op's fwd+bwd
  traffic, one lm-head matmul chunk loop for ``linear_cross_entropy``, the attention forward for
  ``attention``. Measured on a GPU by ``plyx-train``'s ``bench/mfu.py`` (eager vs compiled).

Model code reaches these through ``traceable(name)`` when ``torch.compiler.is_compiling()``; eager
calls keep using ``registry().get(...)`` directly (no recompute).

Two calls need not be custom ops at all (``COMPILE_CHOICES``, set by ``plyx.kernel.training_kernels``):
attention that torch SDPA runs is traced as aten SDPA, whose autograd saves its own log-sum-exp (the
custom op would recompute SDPA in its backward: no saved statistics), and RMSNorm can be traced as plain
torch ops (``rmsnorm_torch``) that Inductor fuses with the residual adds and casts around it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from plyx.kernel import _saving
from plyx.kernel.attention._hybrid import sdpa_suits
from plyx.kernel.attention._sdpa import attention_sdpa

__all__ = ["COMPILE_CHOICES", "OPS", "reached_under_compile", "rmsnorm_torch", "traceable"]

_LIB = "plyx"

#: what the compile path traces (set by ``plyx.kernel.training_kernels``; read while Dynamo traces, which guards
#: on it): ``attention``: ``op`` (the ``plyx::attention`` custom op), ``sdpa`` (torch SDPA traced for plain causal
#: calls, the custom op for the rest), ``sdpa-all`` (SDPA traced for every call); ``rmsnorm``: ``kernel`` (the
#: ``plyx::rmsnorm`` custom ops) or ``inductor`` (``rmsnorm_torch``'s plain ops, fused by Inductor)
COMPILE_CHOICES: dict[str, str] = {"attention": "op", "rmsnorm": "kernel"}


def _select(name: str, *tensors: torch.Tensor, **shape: int) -> Callable[..., Any]:
    from plyx.kernel._default import registry

    return registry().get(name, *tensors, **shape)


def _picked(name: str, *tensors: torch.Tensor, **shape: int) -> Callable[..., Any]:
    """The implementation an op's forward and backward both use: selected as for a call that needs a gradient
    (so the backward's selection, made in the backward, finds the same one)."""
    with torch.enable_grad():
        return _select(name, *tensors, **shape)


#: op name -> the implementation the registry picks for the op's arguments
_PICKS: dict[str, Callable[..., Callable[..., Any]]] = {
    "rmsnorm": lambda x, w, *_: _picked("rmsnorm", x, w, hidden=int(x.shape[-1])),
    "rmsnorm_residual": lambda x, w, *_: _picked("rmsnorm", x, w, hidden=int(x.shape[-1])),
    "swiglu": lambda g, u: _picked("swiglu", g, u, hidden=int(g.shape[-1])),
    "rope": lambda x, c, s, *_: _picked("rope", x, c, s, head_dim=int(x.shape[-1])),
    "rope_qk": lambda q, k, c, s, *_: _picked("rope_qk", q, k, c, s, head_dim=int(q.shape[-1])),
    "attention": lambda q, k, v, *_: _picked("attention", q, k, v, head_dim=int(q.shape[-1])),
    "cross_entropy": lambda z, t, *_: _picked("cross_entropy", z, t),
    "linear_cross_entropy": lambda h, w, t, *_: _picked("linear_cross_entropy", h, w, t),
}


def _own(out: Any, inputs: Sequence[Any]) -> Any:
    """``out`` with every tensor that shares storage with an input or an earlier output copied: a custom op's
    outputs may alias neither (rmsnorm's backward returns one tensor as the gradient of x and of residual)."""
    flat = [a for x in inputs for a in (x if isinstance(x, list | tuple) else (x,))]
    ptrs = {a.untyped_storage().data_ptr() for a in flat if isinstance(a, torch.Tensor) and a.numel()}

    def fix(t: torch.Tensor) -> torch.Tensor:
        if not t.numel():
            return t
        ptr = t.untyped_storage().data_ptr()
        if ptr in ptrs:
            return t.clone()
        ptrs.add(ptr)
        return t

    if isinstance(out, list | tuple):
        return type(out)(fix(t) for t in out)
    return fix(out)


def _with_autograd() -> Any:
    """A guard that restores the autograd dispatch keys an op's implementation runs without (the backward
    differentiates the forward). Autocast stays off inside the ops, as for any op below autocast: the
    implementations run in their inputs' dtypes (model code casts before the call, as in eager)."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in _AUTOGRAD_KEYS:
        exclude = exclude.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


_AUTOGRAD_KEYS = [getattr(torch._C.DispatchKey, k) for k in dir(torch._C.DispatchKey)
                  if k.startswith("Autograd") and k not in ("Autograd", "AutogradFunctionality")]


# -- one call per op: the registry's implementation with the op's positional schema -------------------

def _rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Any:
    return _select("rmsnorm", x, weight, hidden=int(x.shape[-1]))(x, weight, eps=eps)


def _rmsnorm_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, eps: float) -> Any:
    return _select("rmsnorm", x, weight, hidden=int(x.shape[-1]))(x, weight, eps=eps, residual=residual)


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> Any:
    return _select("swiglu", gate, up, hidden=int(gate.shape[-1]))(gate, up)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> Any:
    return _select("rope", x, cos, sin, head_dim=int(x.shape[-1]))(x, cos, sin, interleaved=interleaved)


def _rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> Any:
    return _select("rope_qk", q, k, cos, sin, head_dim=int(q.shape[-1]))(q, k, cos, sin, interleaved=interleaved)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               document_ids: torch.Tensor | None, causal: bool, scale: float | None, window: int | None) -> Any:
    fn = _select("attention", q, k, v, head_dim=int(q.shape[-1]))
    return fn(q, k, v, causal=causal, scale=scale, mask=mask, document_ids=document_ids, window=window)


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, label_smoothing: float,
                   z_loss: float, reduction: str) -> Any:
    return _select("cross_entropy", logits, targets)(logits, targets, ignore_index=ignore_index,
                                                     label_smoothing=label_smoothing, z_loss=z_loss,
                                                     reduction=reduction)


def _linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          bias: torch.Tensor | None, ignore_index: int, label_smoothing: float, z_loss: float,
                          reduction: str, grad: bool = True) -> Any:
    return _select("linear_cross_entropy", hidden, weight, targets)(
        hidden, weight, targets, bias=bias, ignore_index=ignore_index, label_smoothing=label_smoothing,
        z_loss=z_loss, reduction=reduction)


# -- fake (meta) implementations: shapes and dtypes only ----------------------------------------------

def _loss_fake(rows: torch.Tensor, reduction: str) -> torch.Tensor:
    n = rows.shape[0]
    # float32 losses (float64 for float64 inputs, as the reference computes them)
    return rows.new_empty((n,) if reduction == "none" else (), dtype=torch.promote_types(rows.dtype, torch.float32))


_FAKES: dict[str, Callable[..., Any]] = {
    "rmsnorm": lambda x, w, eps: torch.empty_like(x),
    "rmsnorm_residual": lambda x, w, r, eps: (torch.empty_like(x), torch.empty_like(x)),
    "swiglu": lambda g, u: torch.empty_like(g),
    "rope": lambda x, c, s, il: torch.empty_like(x),
    "rope_qk": lambda q, k, c, s, il: (torch.empty_like(q), torch.empty_like(k)),
    # o [B, T, H, Dv]: q's batch, tokens and heads, v's head dim
    "attention": lambda q, k, v, *_: q.new_empty((*q.shape[:-1], v.shape[-1])),
    "cross_entropy": lambda z, t, ii, ls, zl, red: _loss_fake(z, red),
    "linear_cross_entropy": lambda h, w, t, b, ii, ls, zl, red, grad: _loss_fake(h, red),
}

# name -> (schema of the arguments, the call, positions of the differentiable tensor arguments, outputs)
_SPECS: dict[str, tuple[str, Callable[..., Any], tuple[int, ...], int]] = {
    "rmsnorm": ("Tensor x, Tensor weight, float eps", _rmsnorm, (0, 1), 1),
    "rmsnorm_residual": ("Tensor x, Tensor weight, Tensor residual, float eps", _rmsnorm_residual, (0, 1, 2), 2),
    "swiglu": ("Tensor gate, Tensor up", _swiglu, (0, 1), 1),
    "rope": ("Tensor x, Tensor cos, Tensor sin, bool interleaved", _rope, (0,), 1),
    "rope_qk": ("Tensor q, Tensor k, Tensor cos, Tensor sin, bool interleaved", _rope_qk, (0, 1), 2),
    "attention": ("Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor? document_ids, bool causal, float? scale, "
                  "SymInt? window", _attention, (0, 1, 2), 1),
    "cross_entropy": ("Tensor logits, Tensor targets, SymInt ignore_index, float label_smoothing, float z_loss, "
                      "str reduction", _cross_entropy, (0,), 1),
    "linear_cross_entropy": ("Tensor hidden, Tensor weight, Tensor targets, Tensor? bias, SymInt ignore_index, "
                             "float label_smoothing, float z_loss, str reduction, bool grad", _linear_cross_entropy,
                             (0, 1, 3), 1),
}


def _define(name: str) -> Any:
    """Define ``plyx::<name>`` and ``plyx::<name>_backward`` and wire the autograd formula; returns the op.

    The forward returns the op's outputs and its extra saved tensors (``_saving.EXTRAS``); the wrapper model code
    calls (``_CALLS``) hands back only the outputs.
    """
    schema, call, diff, n_out = _SPECS[name]
    pick = _PICKS[name]
    keep_outs = _saving.SAVED_OUTPUTS.get(name, ())
    n_all = n_out + _saving.N_EXTRAS[name]
    returns = "Tensor" if n_all == 1 else "(" + ", ".join(["Tensor"] * n_all) + ")"

    # the implementations never run under Dynamo: where one is called while Dynamo's frame hook is active
    # (code between two graphs of a graph break), Dynamo would otherwise start tracing it as a frame of its
    # own and reach the registry's Triton kernel
    @torch.compiler.disable
    def forward(*args: Any) -> Any:
        split = _saving.split_for(name, pick(*args))
        with torch.no_grad():
            _saving.FORWARD_RUNS[name] += 1
            outs, extras = split.forward(*args)
        out = _own((*outs, *extras), args)
        return out[0] if n_all == 1 else out

    def fake(*args: Any) -> Any:
        out = _FAKES[name](*args)
        out = (*(out if isinstance(out, tuple) else (out,)), *_saving.EXTRAS[name](*args))
        return out[0] if n_all == 1 else out

    op = torch.library.custom_op(f"{_LIB}::{name}", forward, mutates_args=(), schema=f"({schema}) -> {returns}")
    op.register_fake(fake)

    def recompute(grads: list[torch.Tensor], args: tuple[Any, ...]) -> list[torch.Tensor | None]:
        """The fallback: the implementation's forward again, with autograd, differentiated."""
        _saving.FORWARD_RUNS[name] += 1
        with _with_autograd(), torch.enable_grad():
            leaves = list(args)
            for i in diff:
                if isinstance(args[i], torch.Tensor):
                    leaves[i] = args[i].detach().requires_grad_(True)
            out = call(*leaves)
            outs = out if isinstance(out, tuple) else (out,)
            wrt = [leaves[i] for i in diff if isinstance(leaves[i], torch.Tensor)]
            got = iter(torch.autograd.grad(outs, wrt, list(grads[:n_out]), allow_unused=True,
                                           materialize_grads=True))
        return [next(got) if isinstance(args[i], torch.Tensor) else None for i in diff]

    @torch.compiler.disable
    def backward_impl(grads: list[torch.Tensor], saved: list[torch.Tensor], *args: Any) -> list[torch.Tensor]:
        """Gradients of the differentiable arguments (an empty tensor for an absent optional one) from the
        forward's saved outputs and extras (``saved``), or by recompute where the implementation saved none."""
        split = _saving.split_for(name, pick(*args))
        outs, extras = saved[:len(keep_outs)], saved[len(keep_outs):]
        got = None
        if split.backward is not None:
            with torch.no_grad():
                got = split.backward(grads[:n_out], outs, extras, args)
        if got is None:
            got = recompute(grads, args)
        result = [g.contiguous() if g is not None else grads[0].new_empty(0) for g in got]
        return _own(result, (grads, saved, *args))  # type: ignore[no-any-return]

    def backward_fake(grads: list[torch.Tensor], saved: list[torch.Tensor], *args: Any) -> list[torch.Tensor]:
        shaped = _saving.grad_fakes(name, grads, saved, args)
        if shaped is not None:
            return shaped
        return [torch.empty_like(args[i]) if isinstance(args[i], torch.Tensor) else grads[0].new_empty(0)
                for i in diff]

    bwd = torch.library.custom_op(f"{_LIB}::{name}_backward", backward_impl, mutates_args=(),
                                  schema=f"(Tensor[] grads, Tensor[] saved, {schema}) -> Tensor[]")
    bwd.register_fake(backward_fake)

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        outs = output if isinstance(output, tuple) else (output,)
        dropped = _saving.dropped_inputs(name, inputs)
        ctx.tensor_pos = [i for i, a in enumerate(inputs) if isinstance(a, torch.Tensor) and i not in dropped]
        # placeholders of the same shape, dtype and device over one element (stride 0): the backward reads no
        # values of theirs, but selects the same implementation for them as the forward did
        ctx.dropped = [(i, inputs[i].new_empty(()).expand(inputs[i].shape)) for i in dropped]
        ctx.n_saved = len(keep_outs) + n_all - n_out
        ctx.save_for_backward(*[inputs[i] for i in ctx.tensor_pos], *[outs[i] for i in keep_outs],
                              *outs[n_out:])
        ctx.others = [None if isinstance(a, torch.Tensor) else a for a in inputs]
        # an unused output's gradient is zeros of its shape and dtype
        ctx.out_meta = [(o.shape, o.dtype, o.device) for o in outs[:n_out]]

    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        args = list(ctx.others)
        tensors = ctx.saved_tensors
        n_in = len(ctx.tensor_pos)
        for i, t in zip(ctx.tensor_pos, tensors[:n_in], strict=True):
            args[i] = t
        for i, t in ctx.dropped:
            args[i] = t
        saved = list(tensors[n_in:])
        # an unused output's gradient arrives as None (rope_qk's k has its own shape); extras get none
        filled = [g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
                  for g, (shape, dtype, device) in zip(grads[:n_out], ctx.out_meta, strict=True)]
        got = bwd(filled, saved, *args)
        result: list[torch.Tensor | None] = [None] * len(args)
        for i, g in zip(diff, got, strict=True):
            if isinstance(args[i], torch.Tensor) and ctx.needs_input_grad[i]:
                result[i] = g
        return tuple(result)

    op.register_autograd(backward, setup_context=setup_context)
    return op


#: ``plyx::<name>`` ops, defined at import (never inside a traced region: Dynamo cannot trace a definition)
OPS: dict[str, Any] = {name: _define(name) for name in _SPECS}


def _op(name: str) -> Any:
    return OPS[name]


# -- the wrappers model code calls: the kernel name's documented signature ---------------------------

def rmsnorm_torch(x: torch.Tensor, weight: torch.Tensor, *, eps: float = 1e-6,
                  residual: torch.Tensor | None = None) -> Any:
    """The ``rmsnorm`` contract in plain differentiable torch ops, for Inductor to fuse (``compiled_norms``).

    The reference's numerics: ``h = x + residual`` rounded to x's dtype, statistics and the weight product in
    float32 (float64 for float64), ``y`` in x's dtype. Returns ``y``, or ``(y, h)`` with ``residual``.
    """
    c = torch.promote_types(x.dtype, torch.float32)
    h = x if residual is None else (x.to(c) + residual.to(c)).to(x.dtype)
    hc = h.to(c)
    y = (hc * torch.rsqrt(hc.square().mean(-1, keepdim=True) + eps) * weight.to(c)).to(x.dtype)  # [..., D]
    return y if residual is None else (y, h)


def _rmsnorm_call(x: torch.Tensor, weight: torch.Tensor, *, eps: float = 1e-6,
                  residual: torch.Tensor | None = None) -> Any:
    if COMPILE_CHOICES.get("rmsnorm") == "inductor":
        return rmsnorm_torch(x, weight, eps=eps, residual=residual)
    if residual is None:
        return _op("rmsnorm")(x, weight, float(eps))[0]  # (y, rstd)
    y, h, _ = _op("rmsnorm_residual")(x, weight, residual, float(eps))
    return y, h


def _swiglu_call(gate: torch.Tensor, up: torch.Tensor) -> Any:
    return _op("swiglu")(gate, up)


def _rope_call(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False) -> Any:
    return _op("rope")(x, cos, sin, bool(interleaved))


def _rope_qk_call(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                  interleaved: bool = False) -> Any:
    return _op("rope_qk")(q, k, cos, sin, bool(interleaved))


def _attention_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                    scale: float | None = None, mask: torch.Tensor | None = None,
                    document_ids: torch.Tensor | None = None, window: int | None = None,
                    return_lse: bool = False) -> Any:
    if return_lse:
        raise NotImplementedError("plyx::attention (torch.compile path) returns no lse; call the kernel eagerly "
                                  "(outside torch.compile) when return_lse=True is needed")
    choice = COMPILE_CHOICES.get("attention", "op")
    if choice == "sdpa-all" or (choice == "sdpa" and sdpa_suits(q, k, causal=causal, mask=mask,
                                                                 document_ids=document_ids, window=window)):
        # traced: aten SDPA with its own autograd (the saved lse of cuDNN/flash), no recompute in the backward
        return attention_sdpa(q, k, v, causal=causal, scale=scale, mask=mask, document_ids=document_ids,
                              window=window)
    return _op("attention")(q, k, v, mask, document_ids, bool(causal), None if scale is None else float(scale),
                            window)[0]  # (o, lse)


def _cross_entropy_call(logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100,
                        label_smoothing: float = 0.0, z_loss: float = 0.0, reduction: str = "mean",
                        return_argmax: bool = False) -> Any:
    loss = _op("cross_entropy")(logits, targets, int(ignore_index), float(label_smoothing), float(z_loss),
                                reduction)[0]  # (loss, lse)
    if return_argmax:  # no gradient flows through the argmax: plain torch, traced by Inductor
        return loss, logits.argmax(-1)
    return loss


def _linear_cross_entropy_call(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                               bias: torch.Tensor | None = None, ignore_index: int = -100,
                               label_smoothing: float = 0.0, z_loss: float = 0.0, reduction: str = "mean") -> Any:
    # whether the backward will run is known here (traced as a constant under Dynamo), not inside the op
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    return _op("linear_cross_entropy")(hidden, weight, targets, bias, int(ignore_index), float(label_smoothing),
                                       float(z_loss), reduction, grad)[0]


_CALLS: dict[str, Callable[..., Any]] = {
    "rmsnorm": _rmsnorm_call,
    "swiglu": _swiglu_call,
    "rope": _rope_call,
    "rope_qk": _rope_qk_call,
    "attention": _attention_call,
    "cross_entropy": _cross_entropy_call,
    "linear_cross_entropy": _linear_cross_entropy_call,
}


def reached_under_compile(name: str, load: Callable[[], Callable[..., Any]], args: Sequence[Any],
                          kwargs: dict[str, Any]) -> Any:
    """What a Triton implementation does when Dynamo traces a call to it: the call as kernel ``name``'s custom op.

    Model code asks for ``traceable(name)`` under ``torch.compile``, but a Triton implementation can still be
    reached by Dynamo: a callable fetched from the registry before tracing began (a cached or bound kernel),
    or code Dynamo traces as a frame of its own after a graph break, where the eager branch was taken. Tracing
    into it would wrap its Triton launch (``triton_kernel_wrapper_mutation``, whose mutation analysis fails on
    inline PTX: the H100 run's ``tt.elementwise_inline_asm``). Instead:

    - a kernel with a custom op (``rmsnorm``, ``swiglu``, ``rope``, ``rope_qk``, ``attention``, ``cross_entropy``,
      ``linear_cross_entropy``) becomes that op (one opaque node; the registry chooses the implementation
      inside it at run time, for the same inputs);
    - any other kernel (inference-only ones, ``matmul``, the MoE kernels) runs eagerly behind
      ``torch.compiler.disable``: a graph break, never a traced Triton launch;
    - under ``torch.export`` the implementation is traced as before (an exported program holds its ops).

    Args:
        name: the kernel name; load: returns the implementation (imports it on first use);
        args, kwargs: the call's arguments (the kernel name's documented signature).

    Returns:
        What the implementation returns.
    """
    if _exporting():
        return load()(*args, **kwargs)
    op = _CALLS.get(name)
    if op is not None:
        return op(*args, **kwargs)
    return _eagerly(load, args, kwargs)


@torch.compiler.disable
def _eagerly(load: Callable[[], Callable[..., Any]], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    return load()(*args, **kwargs)


def traceable(name: str) -> Callable[..., Any] | None:
    """The ``torch.compile``-safe callable of kernel ``name`` (its documented signature), or None when the
    name has no custom op (inference-only kernels: ``rope_store_kv``, ``gemv``, ...; call those eagerly).

    The implementation is still chosen by the registry, at run time, inside the op. Under ``torch.export``
    (which ``torch.compiler.is_compiling()`` also reports) it returns None: an exported program must hold
    the implementation's own ops (ONNX has no translation for ``plyx::`` ops).
    """
    if _exporting():
        return None
    return _CALLS.get(name)


def _exporting() -> bool:
    """Whether ``torch.export`` (not ``torch.compile``) is tracing.

    ``torch.compiler.is_exporting()`` alone is not enough: on torch 2.11 (the H100 image, 2026-11-24) it
    answers True inside a plain ``torch.compile`` trace, so the custom ops were skipped and Inductor traced
    into the Triton kernels (the compiled 1B step's crash). A Dynamo trace therefore counts as compile;
    ``torch.export``'s default non-strict trace (the one ``torch.onnx.export(dynamo=True)`` tries first)
    runs without Dynamo and still sees the implementations' own ops.
    """
    return torch.compiler.is_exporting() and not torch.compiler.is_dynamo_compiling()
