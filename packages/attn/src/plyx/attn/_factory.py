"""``make_cache``: build any registered KV-cache kind for a model configuration."""

from __future__ import annotations

from typing import Any

from plyx.specs import plugins
from plyx.specs.config.model import ModelConfig
from plyx.specs.kvcache import CacheLayout, KVCache

__all__ = ["cache_kinds", "cache_layout", "make_cache"]


def cache_layout(
    config: ModelConfig,
    *,
    max_seq_len: int | None = None,
    block_size: int | None = None,
    num_blocks: int | None = None,
    device: str = "cpu",
    dtype: Any = None,
) -> CacheLayout:
    """The ``CacheLayout`` a model of ``config`` needs (layers, KV heads, head dim)."""
    import torch

    if dtype is None:
        dtype = config.dtype
    elif not isinstance(dtype, str):  # a torch.dtype
        dtype = str(dtype).removeprefix("torch.")
    return CacheLayout(
        num_layers=config.n_layers,
        num_kv_heads=config.kv_heads,
        head_dim=config.dim_per_head,
        dtype=dtype,
        device=str(torch.device(device)),
        max_seq_len=max_seq_len or config.max_seq_len,
        block_size=block_size,
        num_blocks=num_blocks,
    )


def cache_kinds() -> dict[str, Any]:
    """Every KV-cache kind the installed plugins provide, by name (``Component``s)."""
    return plugins.components("plyx_kv_cache_kinds")


def make_cache(
    kind: str,
    config: ModelConfig,
    *,
    batch_size: int = 1,
    block_size: int = 16,
    num_blocks: int | None = None,
    max_seq_len: int | None = None,
    device: Any = "cpu",
    dtype: Any = None,
    **options: Any,
) -> KVCache:
    """Build a KV cache of ``kind`` (``contiguous``, ``paged`` or a plugin's) sized for ``config``.

    Args:
        kind: a name from ``cache_kinds()``.
        config: the model's configuration (layers, KV heads, head dim, dtype).
        batch_size: sequences held at once (contiguous rows; sizes the paged pool when
            ``num_blocks`` is None).
        block_size, num_blocks: paged geometry; ``num_blocks`` defaults to enough
            blocks for ``batch_size`` sequences of ``max_seq_len``.
        max_seq_len: most tokens per sequence; defaults to ``config.max_seq_len``.
        device, dtype: where and how the cache stores values (dtype defaults to the model's).

    Example::

        cache = make_cache("paged", model.config, batch_size=8, block_size=16)
        logits = model(prompt_ids, cache=cache)
    """
    kinds = cache_kinds()
    if kind not in kinds:
        raise LookupError(
            f"KV-cache kind {kind!r} not found. It is either misspelled or not installed; "
            f"installed kinds: {', '.join(sorted(kinds)) or '(none)'}"
        )
    seq_len = max_seq_len or config.max_seq_len
    paged = kind != "contiguous"
    if paged and num_blocks is None:
        num_blocks = batch_size * -(-seq_len // block_size)
    layout = cache_layout(
        config,
        max_seq_len=seq_len,
        block_size=block_size if paged else None,
        num_blocks=num_blocks if paged else None,
        device=device,
        dtype=dtype,
    )
    if kind == "contiguous":
        options.setdefault("max_batch", batch_size)
    cache = kinds[kind].factory(layout, **options)
    if not isinstance(cache, KVCache):
        raise TypeError(f"the factory of KV-cache kind {kind!r} ({kinds[kind].source}) returned "
                        f"{type(cache).__name__}, which does not satisfy plyx.specs.KVCache")
    return cache
