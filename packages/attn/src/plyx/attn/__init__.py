"""plyx-attn: the attention module and KV caches (contiguous, and paged with copy-on-write prefix sharing).

Kernels (``attention``, ``paged_attention``, ``rope``, ``rmsnorm``) are resolved
by name from the plyx kernel registry; no implementation is imported here.
"""

from typing import Any

__all__ = [
    "KV_CACHE_DTYPES",
    "PAGED_MAX_QUERY",
    "Attention",
    "ContiguousKVCache",
    "KVStep",
    "PagedKVCache",
    "QuantizedPagedKVCache",
    "RMSNorm",
    "STATIC_MAX_QUERY",
    "StaticDecode",
    "VarlenGroup",
    "begin_packed_step",
    "begin_step",
    "reserve_tokens",
    "cache_kinds",
    "cache_layout",
    "check_kv_cache_dtype",
    "make_cache",
    "move_tokens",
    "pack_linears_",
    "packed_for_inference",
    "packed_linear",
    "stacked_for_training",
    "supports_static_decode",
    "tree_attention",
    "tree_depths",
    "varlen_groups",
    "weight_reads_exact",
]


def __getattr__(name: str) -> Any:
    """Load the public names on first use (PEP 562).

    Importing ``plyx.attn`` (and so its plugin entry point, ``plyx.attn._plugin``)
    imports nothing heavy: ``plyx --help`` and ``plyx plugins`` never load torch.
    The names live in ``plyx.attn._exports``.
    """
    if name in __all__:
        from plyx.attn import _exports

        value = getattr(_exports, name)
        globals()[name] = value  # later lookups are plain attribute reads
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
