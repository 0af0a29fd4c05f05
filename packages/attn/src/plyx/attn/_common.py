"""Small helpers shared by the caches: dtype names, argument checks."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from plyx.specs.kvcache import CacheLayout

__all__ = ["DTYPES", "check_kv", "dtype_of", "layout_dtype_name", "unique_ids"]

#: canonical dtype name -> torch dtype
DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
}


def dtype_of(name: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; a torch dtype passes through."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def layout_dtype_name(layout: CacheLayout) -> str:
    return layout.dtype


def unique_ids(seq_ids: Sequence[int]) -> list[int]:
    ids = [int(s) for s in seq_ids]
    if len(set(ids)) != len(ids):
        raise ValueError(f"seq_ids {ids} repeat an id; each sequence may appear once per call")
    return ids


def check_kv(layout: CacheLayout, k: torch.Tensor, v: torch.Tensor, n: int) -> None:
    """``k`` and ``v`` must be ``[n, KV, Dh]`` on the cache's device."""
    want = (n, layout.num_kv_heads, layout.head_dim)
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != want:
            raise ValueError(
                f"append(): `{name}` has shape {tuple(t.shape)}, expected [N, KV, Dh] = {list(want)} "
                f"(N = the tokens the last reserve() made room for)"
            )
        if t.device.type != torch.device(layout.device).type:
            raise ValueError(f"append(): `{name}` is on {t.device}, the cache on {layout.device}; move it first")
