"""plyx-attn: the attention module and KV caches (contiguous, and paged with copy-on-write prefix sharing).

Kernels (``attention``, ``paged_attention``, ``rope``, ``rmsnorm``) are resolved
by name from the plyx kernel registry; no implementation is imported here.
"""

from plyx.attn._attention import Attention
from plyx.attn._contiguous import ContiguousKVCache
from plyx.attn._decode import STATIC_MAX_QUERY, StaticDecode, supports_static_decode
from plyx.attn._factory import cache_kinds, cache_layout, make_cache
from plyx.attn._norm import RMSNorm
from plyx.attn._packing import pack_linears_, packed_for_inference, packed_linear, weight_reads_exact
from plyx.attn._paged import PagedKVCache
from plyx.attn._step import PAGED_MAX_QUERY, KVStep, begin_step

__all__ = [
    "PAGED_MAX_QUERY",
    "Attention",
    "ContiguousKVCache",
    "KVStep",
    "PagedKVCache",
    "RMSNorm",
    "STATIC_MAX_QUERY",
    "StaticDecode",
    "begin_step",
    "cache_kinds",
    "cache_layout",
    "make_cache",
    "pack_linears_",
    "packed_for_inference",
    "packed_linear",
    "supports_static_decode",
    "weight_reads_exact",
]
