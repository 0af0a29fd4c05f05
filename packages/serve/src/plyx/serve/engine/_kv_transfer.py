"""Export and import the KV blocks of a prompt: what a disaggregated prefill hands to the decode engine.

The hand-over goes through the prefix cache, as vLLM's KV connectors do (the
transferred blocks are an "external prefix-cache hit"): the prefill engine computes
the prompt, its full blocks land in its prefix cache, ``export_prefix`` copies them
out; the decode engine's ``import_prefix`` writes them into fresh blocks of its pool
and registers them in its prefix cache, and the request is then added as usual: its
admission matches those blocks and computes only the rest of the prompt (the tail
after the last full block, at least its last token, whose logits give the first
sampled token). So the scheduler, sampling and the generators stay the decode
engine's own, unchanged: with the handed-over blocks the output is the colocated
engine's, token for token.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

import attrs
import torch
from plyx.specs.errors import ConfigError

__all__ = ["KVBlocks", "check_transferable", "export_prefix", "import_prefix", "kv_geometry"]

#: sequence ids of import staging entries: above request ids, below the prefix cache's holders (1 << 40)
_STAGING_ID = 1 << 39


@attrs.frozen
class KVBlocks:
    """The keys and values of a prompt's first ``num_tokens`` tokens (whole blocks).

    Attributes:
        num_tokens: tokens covered (``num_blocks * block_size``; 0: nothing to hand over).
        k, v: ``[L, num_blocks, block_size, KV, Dh]`` in the cache's dtype.
    """

    num_tokens: int
    k: torch.Tensor
    v: torch.Tensor


def kv_geometry(engine: Any) -> tuple[int, int, int, int]:
    """``(layers, block_size, kv_heads, head_dim)`` of the engine's cache: both ends of a hand-over must agree."""
    layout = engine.cache.layout
    return (int(layout.num_layers), int(layout.block_size), int(layout.num_kv_heads), int(layout.head_dim))


def check_transferable(engine: Any) -> None:
    """Raise ``ConfigError`` when the engine's KV blocks cannot be exported or imported.

    The hand-over needs the prefix cache (the blocks enter and leave through it), a plain paged cache (a
    quantised one keeps per-token scales beside its pools), and no resident adapters (their KV is not shared).
    """
    if engine.prefix is None:
        raise ConfigError("EngineConfig.prefix_caching", "disaggregated prefill hands KV blocks over through the "
                          "prefix cache, which is off", value=False, fix="leave prefix caching on (drop "
                          "--no-prefix-caching)")
    if hasattr(engine.cache, "kv_scales"):
        raise ConfigError("EngineConfig.kv_cache_dtype", "disaggregated prefill hands over plain KV blocks; a "
                          "quantised cache is not supported yet", value=engine.config.kv_cache_dtype,
                          fix="use --kv-cache-dtype auto (or bf16) with --disaggregate")
    if engine.lora is not None:
        raise ConfigError("lora", "disaggregated prefill serves the base model only (adapter KV is not shared)",
                          value=", ".join(engine.lora.names), fix="drop --lora, or serve without --disaggregate")


def export_prefix(engine: Any, prompt_ids: Seq[int]) -> KVBlocks:
    """The full blocks of ``prompt_ids`` in the engine's prefix cache (up to its last token, which the decode
    side computes), copied out of the pools.

    Args:
        engine: an ``Engine`` that computed the prompt (its prefix cache holds the blocks).
        prompt_ids: the prompt's tokens.

    Returns:
        ``KVBlocks`` (``num_tokens`` 0 when no full block is cached).
    """
    check_transferable(engine)
    nodes = engine.prefix.match(list(prompt_ids), max_tokens=len(prompt_ids) - 1)
    cache = engine.cache
    ids = torch.tensor([n.block for n in nodes], dtype=torch.long, device=engine.device)
    ks, vs = [], []
    for layer in range(cache.layout.num_layers):
        k_pool, v_pool = cache.kv_blocks(layer)  # [num_blocks, bs, KV, Dh]
        ks.append(k_pool.index_select(0, ids))
        vs.append(v_pool.index_select(0, ids))
    return KVBlocks(len(nodes) * cache.block_size, torch.stack(ks), torch.stack(vs))  # [L, nb, bs, KV, Dh]


def import_prefix(engine: Any, prompt_ids: Seq[int], blocks: KVBlocks) -> int:
    """Write ``blocks`` into free blocks of the engine's pool and register them in its prefix cache as
    ``prompt_ids``'s first ``blocks.num_tokens`` tokens; call it on the engine's thread, just before
    ``add_request`` of that prompt.

    Blocks already cached are reused as they are. When the pool has no room even after evicting unused prefix
    blocks, nothing is imported and the request computes its prompt itself (same output, slower).

    Returns:
        The prompt tokens now cached (0 when nothing was imported).
    """
    check_transferable(engine)
    n = blocks.num_tokens
    if n == 0:
        return 0
    bs = engine.cache.block_size
    if n % bs or n > len(prompt_ids) - 1 or tuple(blocks.k.shape[:2]) != (engine.cache.layout.num_layers, n // bs):
        raise ValueError(f"KV blocks of {n} tokens, shape {tuple(blocks.k.shape)}, do not fit a prompt of "
                         f"{len(prompt_ids)} tokens with block size {bs}; both engines need one cache geometry")
    prompt = [int(t) for t in prompt_ids]
    prefix, cache = engine.prefix, engine.cache
    if len(prefix.match(prompt, max_tokens=n)) * bs >= n:
        return n
    staging = _STAGING_ID + len(cache.sequences())
    while staging in cache.sequences():
        staging += 1
    cache.allocate(staging)
    need = cache.blocks_needed([staging], [n])
    if need > cache.num_free_blocks():
        prefix.evict(need - cache.num_free_blocks())
    if need > cache.num_free_blocks():
        cache.evict(staging)
        return 0
    try:
        cache.reserve([staging], [n])
        ids = torch.tensor(cache.blocks(staging), dtype=torch.long, device=engine.device)
        for layer in range(cache.layout.num_layers):
            k_pool, v_pool = cache.kv_blocks(layer)  # [num_blocks, bs, KV, Dh]
            k_pool.index_copy_(0, ids, blocks.k[layer].to(k_pool.device, k_pool.dtype))
            v_pool.index_copy_(0, ids, blocks.v[layer].to(v_pool.device, v_pool.dtype))
        prefix.insert(staging, prompt, n)  # holders fork the staging entry: they keep the blocks
    finally:
        cache.evict(staging)
    return n
