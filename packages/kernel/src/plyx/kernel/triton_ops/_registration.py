"""Declarations of the Triton implementations: capability predicates, priorities, lazy callables."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from plyx.kernel._registry import _tracing
from plyx.specs.kernels import Capability, KernelImpl

__all__ = ["register_all", "TRITON_CAPABILITY"]

#: bf16 needs sm80; older GPUs keep the references
TRITON_CAPABILITY = dict(devices={"cuda"}, dtypes={"float32", "bfloat16", "float16"}, min_compute_capability=(8, 0),
                         requires=("triton",))


_LAZY: dict[tuple[str, str], Callable[..., Any]] = {}


def _lazy(module: str, attr: str) -> Callable[..., Any]:
    """A callable that imports ``plyx.kernel.triton_ops.<module>`` (and triton) on its first call.

    One object per op, so registering again (a second registry, a re-run hook) stays re-entrant.
    """
    if (module, attr) in _LAZY:
        return _LAZY[(module, attr)]
    target: list[Callable[..., Any]] = []

    def load() -> Callable[..., Any]:
        if not target:
            target.append(getattr(importlib.import_module(f"plyx.kernel.triton_ops.{module}"), attr))
        return target[0]

    def call(*args: Any, **kwargs: Any) -> Any:
        if _tracing():
            # Dynamo reached the Triton implementation itself (a callable fetched from the registry outside
            # the traced region, or a frame Dynamo started after a graph break): never trace a Triton launch
            # (Inductor's mutation analysis fails on inline PTX); the kernel's custom op instead
            from plyx.kernel._custom_ops import reached_under_compile

            return reached_under_compile(module, load, args, kwargs)
        return load()(*args, **kwargs)

    call.__name__ = call.__qualname__ = attr
    call.__doc__ = f"plyx.kernel.triton_ops.{module}.{attr} (imported on first call)"
    _LAZY[(module, attr)] = call
    return call


# name -> (priority, extra capability, description)
_OPS: dict[str, tuple[int, dict[str, Any], str]] = {
    "rmsnorm": (10, {"shape_limits": {"hidden": (1, 65536)}}, "Triton fused RMSNorm (+ residual add), one row per program"),
    "swiglu": (10, {}, "Triton fused silu(gate) * up, forward and backward"),
    "rope": (10, {"shape_limits": {"head_dim": (2, 1024)}}, "Triton RoPE, rotate-half or interleaved, partial rotary, per-batch position tables"),
    "rope_qk": (10, {"shape_limits": {"head_dim": (2, 1024)}},
                "Triton RoPE of q and k in one launch (GQA head counts), forward and backward"),
    # no backward: with grad required the registry falls back to the reference, which explains the error
    "rope_store_kv": (10, {"shape_limits": {"head_dim": (2, 1024)}, "backward": False},
                      "Triton RoPE of q and k, k and v stored at cache slots, one launch (inference only)"),
    # float8 caches need Hopper: the op refuses them on older GPUs with an error naming the fix (use int8)
    "store_kv_quant": (10, {"backward": False},
                       "Triton int8 / fp8_e4m3 quantisation of k and v (per token and head scales) at cache slots"),
    "rope_store_kv_quant": (10, {"shape_limits": {"head_dim": (2, 1024)}, "backward": False},
                            "Triton RoPE of q and k, k and v quantised (int8 / fp8_e4m3) into cache slots, one launch"),
    # decode-sized only (the rows limit is triton_ops.rmsnorm_linear.MAX_ROWS); larger M takes the reference
    "rmsnorm_linear": (10, {"shape_limits": {"rows": (1, 2)}, "backward": False},
                       "Triton RMSNorm (+ residual) fused into a skinny projection (+ SwiGLU), M <= 2 (inference only)"),
    "swiglu_linear": (10, {"shape_limits": {"rows": (1, 2)}, "backward": False},
                      "Triton down projection of silu(gate) * up, one launch, M <= 2 (inference only)"),
    # decode-sized only (triton_ops.gemv.MAX_ROWS): at more rows cuBLAS (the reference) reads the weight once too
    "gemv": (10, {"shape_limits": {"rows": (1, 2)}, "backward": False},
             "Triton weight-streaming GEMV x @ W.T (+ bias), M <= 2 (inference only)"),
    "cross_entropy": (10, {}, "Triton online-softmax cross-entropy: one read forward (loss, lse), one read + write backward"),
    "linear_cross_entropy": (10, {}, "chunked cuBLAS lm-head + Triton cross-entropy, gradients in the forward pass"),
    # below the cuBLAS reference: measured slower at the benchmark shapes (bench/results); force it to use it
    "matmul": (-10, {}, "Triton tiled GEMM (forward and backward through the same kernel)"),
    "moe_permute": (10, {}, "device routing sort + Triton row copies, forward and backward (no atomics)"),
    "moe_unpermute": (10, {}, "Triton weighted gather-sum of expert rows, forward and backward (no atomics)"),
    "grouped_gemm": (10, {}, "Triton grouped GEMM over experts' row blocks, device tile schedule (no host sync)"),
}


def register_all(registry: Any) -> None:
    for name, (priority, extra, description) in _OPS.items():
        capability = Capability(**{**TRITON_CAPABILITY, **extra})
        registry.register(KernelImpl(name, "triton", _lazy(name, name), capability=capability,
                                     priority=priority, description=description))
