"""The built-in plugin of plyx-attn, registered under the `plyx` entry-point group."""

from __future__ import annotations

from typing import Any

from plyx.specs import Component, hookimpl

plyx_contracts = {"hooks": "1.0", "kvcache": "1.0"}


def _contiguous(layout: Any, *, max_batch: int | None = None) -> Any:
    """``max_batch`` defaults to the rows a paged layout's token capacity fills (or 1)."""
    from plyx.attn._contiguous import ContiguousKVCache

    if max_batch is None:
        tokens = (layout.num_blocks or 0) * (layout.block_size or 0)
        max_batch = max(1, tokens // layout.max_seq_len)
    return ContiguousKVCache(layout, max_batch=max_batch)


def _paged(layout: Any) -> Any:
    from plyx.attn._paged import PagedKVCache

    return PagedKVCache(layout)


def _paged_int8(layout: Any) -> Any:
    from plyx.attn._paged_quant import QuantizedPagedKVCache

    return QuantizedPagedKVCache(layout, kv_dtype="int8")


def _paged_fp8(layout: Any) -> Any:
    from plyx.attn._paged_quant import QuantizedPagedKVCache

    return QuantizedPagedKVCache(layout, kv_dtype="fp8_e4m3")


@hookimpl
def plyx_kv_cache_kinds() -> list[Component]:
    return [
        Component("contiguous", _contiguous, "one preallocated [max_batch, max_seq_len] row per sequence"),
        Component("paged", _paged, "fixed-size blocks in a pool, refcounted copy-on-write prefix sharing"),
        Component("paged_int8", _paged_int8, "the paged cache storing int8 keys/values, per-token per-head scales"),
        Component("paged_fp8_e4m3", _paged_fp8,
                  "the paged cache storing float8_e4m3fn keys/values, per-token per-head scales (CPU, Hopper)"),
    ]
