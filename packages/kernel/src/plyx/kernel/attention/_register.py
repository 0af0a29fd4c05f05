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
