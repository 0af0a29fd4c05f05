"""The attention implementations and their capability predicates."""

from __future__ import annotations

from typing import Any

from plyx.specs import Capability, KernelImpl

__all__ = ["register_all"]

#: what the Triton kernels are compiled for; predicates and tests share these
TRITON_HEAD_DIMS = frozenset({64, 128})
TRITON_DTYPES = frozenset({"bfloat16", "float16"})
#: Ampere or newer: bf16 tensor cores and the shared memory the tiles need
TRITON_MIN_CC = (8, 0)
#: float8_e4m3fn conversions in Triton: Hopper or newer
FP8_MIN_CC = (9, 0)


def register_all(registry: Any) -> None:
    from plyx.kernel import attention as attn

    registry.register(
        KernelImpl(
            name="attention",
            impl="reference",
            fn=attn.attention_reference,
            capability=Capability(),
            priority=0,
            description="plain torch, materialises [T, S] scores; any device and dtype, float64 gradcheck",
        )
    )
    registry.register(
        KernelImpl(
            name="paged_attention",
            impl="reference",
            fn=attn.paged_attention_reference,
            capability=Capability(),
            priority=0,
            description="plain torch, gathers each sequence's blocks; any device and dtype",
        )
    )
    registry.register(
        KernelImpl(
            name="attention",
            impl="sdpa",
            fn=attn.attention_sdpa,
            capability=Capability(),
            priority=10,
            description="torch scaled_dot_product_attention with masks for windows, documents and decode alignment",
        )
    )
    registry.register(
        KernelImpl(
            name="attention",
            impl="triton",
            fn=attn.attention_triton,
            capability=Capability(
                devices={"cuda"},
                dtypes=TRITON_DTYPES,
                min_compute_capability=TRITON_MIN_CC,
                shape_in={"head_dim": TRITON_HEAD_DIMS},
                requires=("triton",),
                backward=True,
            ),
            priority=20,
            description="Triton FlashAttention-2 forward+backward: causal/full, GQA, documents, window, masks",
        )
    )
    registry.register(
        KernelImpl(
            name="attention",
            impl="hybrid",
            fn=attn.attention_hybrid,
            capability=Capability(
                devices={"cuda"},
                dtypes=TRITON_DTYPES,
                min_compute_capability=TRITON_MIN_CC,
                shape_in={"head_dim": TRITON_HEAD_DIMS},
                requires=("triton",),
                backward=True,
            ),
            # never chosen by priority: the training step names it (plyx.kernel.training_kernels)
            priority=5,
            description="torch SDPA (cuDNN/flash) for plain causal calls, the Triton flash kernel for packed "
                        "documents, windows, masks and lse",
        )
    )
    registry.register(
        KernelImpl(
            name="paged_attention",
            impl="triton",
            fn=attn.paged_attention_triton,
            capability=Capability(
                devices={"cuda"},
                dtypes=TRITON_DTYPES,
                min_compute_capability=TRITON_MIN_CC,
                shape_in={"head_dim": TRITON_HEAD_DIMS},
                requires=("triton",),
                backward=False,
            ),
            priority=20,
            description="Triton paged decode attention over a block table, split-K for long contexts, GQA",
        )
    )

    # quantised pools (int8 / float8_e4m3fn with per-token, per-head scales). The query's dtype is q's; the
    # storage is told by the shape key `fp8` (0: int8, 1: float8_e4m3fn), so fp8 takes the Triton kernel on
    # Hopper only (float8 conversions) and int8 on any GPU the paged kernel runs on
    registry.register(
        KernelImpl(
            name="paged_attention_quant",
            impl="reference",
            fn=attn.paged_attention_quant_reference,
            capability=Capability(),
            priority=0,
            description="plain torch: dequantises the tables' blocks, then the paged reference; any device and dtype",
        )
    )
    for impl, fp8, min_cc, what in (("triton", 0, TRITON_MIN_CC, "int8"), ("triton_fp8", 1, FP8_MIN_CC, "fp8_e4m3")):
        registry.register(
            KernelImpl(
                name="paged_attention_quant",
                impl=impl,
                fn=attn.paged_attention_quant_triton,
                capability=Capability(
                    devices={"cuda"},
                    dtypes=TRITON_DTYPES,
                    min_compute_capability=min_cc,
                    shape_in={"head_dim": TRITON_HEAD_DIMS, "fp8": frozenset({fp8})},
                    requires=("triton",),
                    backward=False,
                ),
                priority=20,
                description=f"Triton paged decode attention over {what} pools, dequantised in registers, split-K, GQA",
            )
        )
