"""The built-in plugin of plyx-kernel, registered under the ``plyx`` entry-point group.

It arrives the same way a third-party kernel plugin does: the registry calls
these hooks on first use.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from plyx.specs import hookimpl
from plyx.specs.kernels import KernelImpl

plyx_contracts = {"hooks": "1.0", "kernels": "1.0"}

_REFERENCES = {
    "matmul": "torch.matmul (cuBLAS on CUDA)",
    "rmsnorm": "PyTorch RMSNorm, float32 statistics, optional fused residual add",
    "swiglu": "PyTorch silu(gate) * up in float32",
    "rope": "PyTorch RoPE, rotate-half or interleaved, partial rotary",
    "rope_qk": "PyTorch RoPE of q and k (rope twice), rotate-half or interleaved, partial rotary, GQA",
    "rope_store_kv": "PyTorch RoPE of q and k, k and v stored at cache slots",
    "store_kv_quant": "PyTorch int8 / fp8_e4m3 quantisation (per token and head scales), stored at cache slots",
    "rope_store_kv_quant": "PyTorch RoPE of q and k, k and v quantised (int8 / fp8_e4m3) into cache slots",
    "rmsnorm_linear": "PyTorch RMSNorm (+ residual) then the projection (+ SwiGLU)",
    "swiglu_linear": "PyTorch silu(gate) * up of a packed gate/up output, then the down projection",
    "gemv": "torch.nn.functional.linear (cuBLAS on CUDA), any number of rows",
    "cross_entropy": "PyTorch cross-entropy with label smoothing, z-loss and argmax",
    "linear_cross_entropy": "PyTorch chunked lm-head + cross-entropy (never holds [N, V] logits)",
    "moe_permute": "PyTorch stable sort by expert + index_select (dropless token permutation)",
    "moe_unpermute": "PyTorch gather of each token's expert rows, weighted sum in float32",
    "grouped_gemm": "per-expert loop of F.linear over each expert's rows (reads offsets on the host)",
}


@hookimpl
def plyx_register_kernels(registry: Any) -> None:
    """The pure-PyTorch references (priority 0, any device) and the Triton kernels (CUDA)."""
    from plyx.kernel import reference
    from plyx.kernel._cases import add_kernel_cases

    add_kernel_cases()  # the conformance cases of the names plyx-kernel adds (rope_qk)
    for name, description in _REFERENCES.items():
        registry.register(KernelImpl(name, "reference", getattr(reference, name), priority=0, description=description))
    from plyx.kernel.triton_ops import register as register_triton

    register_triton(registry)


@hookimpl
def plyx_register_attention_backends(registry: Any) -> None:
    """The attention kernels of ``plyx.kernel.attention``, when that subpackage is present."""
    if importlib.util.find_spec("plyx.kernel.attention") is None:
        return
    from plyx.kernel import attention

    attention.register(registry)


@hookimpl
def plyx_cli_commands() -> list[Any]:
    from plyx.kernel._cli import command

    return [command()]
