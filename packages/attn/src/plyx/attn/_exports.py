"""The public names of ``plyx.attn``, imported on first use by its ``__getattr__`` (keeps the package light)."""
# re-exports: plyx.attn.__all__ names them and its __getattr__ serves them
# ruff: noqa: F401

from plyx.attn._attention import Attention
from plyx.attn._contiguous import ContiguousKVCache
from plyx.attn._decode import STATIC_MAX_QUERY, StaticDecode, supports_static_decode
from plyx.attn._factory import cache_kinds, cache_layout, make_cache
from plyx.attn._norm import RMSNorm
from plyx.attn._packing import (
    pack_linears_,
    packed_for_inference,
    packed_linear,
    stacked_for_training,
    weight_reads_exact,
)
from plyx.attn._paged import PagedKVCache
from plyx.attn._paged_quant import KV_CACHE_DTYPES, QuantizedPagedKVCache, check_kv_cache_dtype
from plyx.attn._step import PAGED_MAX_QUERY, KVStep, begin_step, reserve_tokens
from plyx.attn._varlen import VarlenGroup, begin_packed_step, move_tokens, tree_attention, tree_depths, varlen_groups
