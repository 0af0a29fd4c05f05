"""``begin_packed_step``: one flattened (varlen) token batch over a paged cache, prefill chunks and decodes mixed.

A serving step feeds each scheduled sequence its next ``n_i`` tokens: 1 for a decoding
sequence, a chunk of its prompt for a prefilling one. Run as one ``[B, T]`` batch the
rows would be padded to the longest chunk; run as one forward per group of equal ``n``
every layer's projections launch once per group. Packed, the ``N = sum n_i`` tokens form
one ``[1, N]`` row: the embeddings, every projection, norm and MLP run once over all of
them, and only attention looks at which sequence a token belongs to::

    ids, positions, step = begin_packed_step(cache, seq_ids, counts, tokens, device)
    hidden = model(ids, position_ids=positions, kv_step=step, return_hidden=True)   # [1, N, D]

Each token's key and value are written to its cache slot (``step.slots``, the flat slot
of every token, computed on the host); attention then reads every sequence's blocks
through the paged kernel. Rows of equal ``n`` that lie next to each other form one
attention group (``VarlenGroup``): a ``[rows, n]`` view of the flat queries, bottom-right
causal against the row's cache (the chunk attends its cached prefix and causally within
itself; a decode row attends its cache), so a step with decodes and one prefill chunk
costs two attention launches per layer and one launch of everything else. Callers that
order rows by ``n`` (decodes first) get the fewest groups.

Needs a block-addressable cache (``supports_static_decode``: ``PagedKVCache``, or any cache
with ``block_size``, ``kv_blocks`` and ``seq_blocks``).

Token trees (speculative tree verification, Medusa's "tree attention", Cai et al. 2024 §2.1.2): a row given
``tree_parents`` feeds a tree of candidate continuations rather than a chain. Its tokens take cache slots in
feed order as usual, but token j sits at position ``before + depth(j)`` and attends the row's cached prefix
plus its own ancestors (itself included), never its siblings' branches. Such a row forms its own attention
group, whose ``tree_mask`` sends it to ``tree_attention`` (keys gathered through the block table, the
``attention`` kernel with an explicit mask) instead of the bottom-right causal paged kernel. After
verification ``move_tokens`` copies the accepted path's keys and values to consecutive slots and the caller
crops the rest.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
from plyx.attn._decode import supports_static_decode
from plyx.attn._step import KVStep, reserve_tokens
from plyx.specs.kvcache import KVCache

__all__ = ["VarlenGroup", "begin_packed_step", "move_tokens", "tree_attention", "tree_depths", "varlen_groups"]


@attrs.frozen
class VarlenGroup:
    """Consecutive rows of a packed step that feed the same number of tokens.

    Attributes:
        start: index of the group's first token in the flat ``[N]`` batch.
        rows: sequences in the group. query_len: tokens each feeds (its ``rows * query_len`` tokens follow
            ``start`` row by row).
        block_tables: int32 ``[rows, W]``; context_lens: int32 ``[rows]``, tokens cached after the step
            (the new ones included), as ``paged_attention`` reads them.
        tree_mask: bool ``[query_len, query_len]`` for rows feeding a token tree (``tree_parents``): entry
            ``[i, j]`` is True where token j is token i or one of its ancestors. None: causal rows.
    """

    start: int
    rows: int
    query_len: int
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    tree_mask: torch.Tensor | None = None


def varlen_groups(counts: Sequence[int], keys: Sequence[Any] | None = None) -> list[tuple[int, int, int, int]]:
    """Maximal runs of equal counts (and equal ``keys``, when given: rows of different token trees never share
    a group): ``(first row, rows, count, first token)`` each, in order."""
    runs: list[tuple[int, int, int, int]] = []
    token = 0
    for i, n in enumerate(counts):
        same_key = keys is None or (runs and keys[runs[-1][0]] == keys[i])
        if runs and same_key and runs[-1][2] == n and runs[-1][0] + runs[-1][1] == i:
            first, rows, _, start = runs[-1]
            runs[-1] = (first, rows + 1, n, start)
        else:
            runs.append((i, 1, n, token))
        token += n
    return runs


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Depth of every token of a tree given as parent indices (``parents[0] == -1``: the root; each other
    ``parents[j]`` in ``[0, j)``); a malformed tree is a ValueError naming the bad entry."""
    if not parents or parents[0] != -1:
        raise ValueError(f"a token tree's first token is its root (parent -1); got parents {list(parents)[:8]}")
    depths = [0]
    for j, p in enumerate(parents[1:], start=1):
        if not 0 <= p < j:
            raise ValueError(f"tree token {j} has parent {p}; parents must come earlier in feed order (0 <= p < {j})")
        depths.append(depths[p] + 1)
    return depths


def _ancestor_mask(parents: Sequence[int]) -> list[list[bool]]:
    """``[T, T]``: row i marks token i and its ancestors (what token i attends among the tree's tokens)."""
    rows: list[list[bool]] = []
    for i, p in enumerate(parents):
        row = list(rows[p]) if p >= 0 else [False] * len(parents)
        row[i] = True
        rows.append(row)
    return rows


def begin_packed_step(cache: KVCache, seq_ids: Sequence[int], counts: Sequence[int],
                      tokens: Sequence[int] | torch.Tensor, device: torch.device, *,
                      tree_parents: Mapping[int, Sequence[int]] | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor, KVStep]:
    """Reserve ``counts[i]`` tokens for each of ``seq_ids`` and plan one packed forward over them.

    Args:
        cache: a block-addressable cache; unknown ``seq_ids`` are allocated.
        seq_ids: one per row, each once. counts: new tokens per row (>= 1).
        tokens: the ``sum(counts)`` new token ids, row after row: host ints, or a ``[N]`` tensor already on
            ``device`` (tokens sampled there: no round trip through the host).
        device: where the model runs.
        tree_parents: rows (by index) that feed a token tree, each with its ``counts[row]`` parent indices
            (``-1`` for the root, the row's first token): token j is placed at position ``before + depth(j)``
            and attends the cached prefix and its ancestors only (``tree_attention``).

    Returns:
        ``(ids [1, N], positions [1, N], step)``: pass them as ``model(ids, position_ids=positions,
        kv_step=step)``; the step's ``varlen`` groups say how attention reads the cache.

    The reserve is all or nothing (``CacheFullError`` leaves the cache as it was).
    """
    if not supports_static_decode(cache):
        raise TypeError(f"{type(cache).__name__} cannot run packed steps: it is not block-addressable "
                        "(block_size, kv_blocks, seq_blocks); run one forward per group instead")
    ids = [int(s) for s in seq_ids]
    counts = [int(n) for n in counts]
    if len(counts) != len(ids) or not ids:
        raise ValueError(f"a packed step needs one count per sequence (got {len(ids)} ids, {len(counts)} counts)")
    if min(counts) < 1:
        raise ValueError(f"every row of a packed step feeds >= 1 token (counts {counts})")
    total = sum(counts)
    if len(tokens) != total:
        raise ValueError(f"got {len(tokens)} tokens for counts summing to {total}; pass every row's new tokens")
    trees = dict(tree_parents or {})
    depths = {}
    for row, parents in trees.items():
        if not 0 <= row < len(ids) or len(parents) != counts[row]:
            raise ValueError(f"tree_parents[{row}] must give one parent per token of row {row} "
                             f"({counts[row] if 0 <= row < len(ids) else 'no such row'} tokens), got {len(parents)}")
        depths[row] = tree_depths(parents)
    reserve_tokens(cache, ids, counts)
    bs = int(cache.block_size)  # type: ignore[attr-defined]
    positions: list[int] = []
    slots: list[int] = []
    rows: list[list[int]] = []
    ends: list[int] = []
    for r, (sid, n) in enumerate(zip(ids, counts)):
        blocks = cache.seq_blocks(sid)  # type: ignore[attr-defined]
        end = cache.length(sid)
        rows.append(list(blocks[:-(-end // bs)]))
        ends.append(end)
        for p in range(end - n, end):
            slots.append(blocks[p // bs] * bs + p % bs)
        if r in depths:  # a tree's token sits at its depth past the prefix: the position on its own path
            positions.extend(end - n + d for d in depths[r])
        else:
            positions.extend(range(end - n, end))
    # one host-to-device copy for the per-token inputs: [ids | positions | slots], int64
    on_device = isinstance(tokens, torch.Tensor)
    host_ids = [] if on_device else [int(t) for t in tokens]  # type: ignore[union-attr]
    flat = torch.tensor(host_ids + positions + slots, dtype=torch.long).to(device, non_blocking=True)
    if on_device:
        flat = torch.cat([tokens.reshape(-1).to(device=device, dtype=torch.long), flat])  # type: ignore[union-attr]
    width = max(len(r) for r in rows)
    # [R, W] block tables padded with block 0 (never read: past each row's length), then [R] lengths; one copy
    meta = torch.tensor([b for r in rows for b in r + [0] * (width - len(r))] + ends, dtype=torch.int32)
    meta = meta.to(device, non_blocking=True)
    tables, lens = meta[:len(ids) * width].view(len(ids), width), meta[len(ids) * width:]
    keys = [tuple(trees[r]) if r in trees else None for r in range(len(ids))] if trees else None
    masks: dict[tuple[int, ...], torch.Tensor] = {}
    for key in set(keys or ()) - {None}:
        masks[key] = torch.tensor(_ancestor_mask(key), dtype=torch.bool).to(device, non_blocking=True)
    groups = tuple(VarlenGroup(start, rows, n, tables[first:first + rows], lens[first:first + rows],
                               masks[keys[first]] if keys is not None and keys[first] is not None else None)
                   for first, rows, n, start in varlen_groups(counts, keys))
    step = KVStep(
        cache=cache,
        seq_ids=tuple(ids),
        token_index=None,
        lengths_before=flat[total:2 * total],
        lengths_after=(),
        paged=None,
        key_mask=None,
        slots=flat[2 * total:],
        varlen=groups,
    )
    return flat[:total][None], flat[total:2 * total][None], step


def tree_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, group: VarlenGroup, *,
                   scale: float) -> torch.Tensor:
    """Attention of a token-tree group's queries over each row's cached prefix and the query's ancestors.

    Args:
        q: ``[rows, T, H, Dh]`` the group's queries (T tree tokens per row, feed order), in the pools' dtype.
        k_pool, v_pool: one layer's pools ``[num_blocks, block_size, KV, Dh]`` (the tree's keys already stored).
        group: the ``VarlenGroup`` (``tree_mask`` set). scale: the softmax scale.

    Returns:
        ``[rows, T, H, Dh]``.

    The keys are gathered through the block table (``[rows, W * block_size]``, the width of the step's longest
    row) and masked: key s of a row is visible to tree token i when s lies in the prefix (before the tree's first
    slot) or is the slot of one of i's ancestors (``tree_mask``). Trees are short (a few dozen tokens) and this
    runs only on verification steps, so the gathered path's cost is what the paged kernel's causal-only
    contract leaves.
    """
    from plyx.attn._kernels import kernel

    assert group.tree_mask is not None
    R, T = q.shape[:2]
    kv = k_pool.shape[2:]
    tables = group.block_tables.long()  # (R, W)
    S = tables.shape[1] * k_pool.shape[1]
    keys = k_pool.index_select(0, tables.reshape(-1)).view(R, S, *kv)  # (R, S, KV, Dh)
    values = v_pool.index_select(0, tables.reshape(-1)).view(R, S, *kv)
    first = group.context_lens.long() - T  # (R,) slot of each row's root
    rel = torch.arange(S, device=q.device)[None, :] - first[:, None]  # (R, S): key slot relative to the root
    in_tree = (rel >= 0) & (rel < T)
    ancestors = group.tree_mask[:, rel.clamp(0, T - 1)].permute(1, 0, 2)  # (R, T, S)
    mask = (rel < 0)[:, None, :] | (in_tree[:, None, :] & ancestors)  # (R, T, S)
    fn = kernel("attention", q, keys, values, head_dim=q.shape[-1])
    return fn(q, keys, values, causal=False, scale=scale, mask=mask[:, None])  # type: ignore[no-any-return]


def move_tokens(cache: KVCache, moves: Sequence[tuple[int, Sequence[int], Sequence[int]]]) -> None:
    """Copy keys and values between positions of cached sequences, on every layer: for each
    ``(seq_id, src, dst)`` position ``src[i]`` is copied to ``dst[i]`` (all reads happen before the writes).

    Tree verification keeps the accepted path: its tokens were fed at scattered tree slots and are moved to
    the consecutive positions after the root; the caller then crops the sequence to the kept length.
    """
    bs = int(cache.block_size)  # type: ignore[attr-defined]
    src_slots: list[int] = []
    dst_slots: list[int] = []
    for sid, src, dst in moves:
        blocks = cache.seq_blocks(sid)  # type: ignore[attr-defined]
        for a, b in zip(src, dst):
            if a != b:
                src_slots.append(blocks[a // bs] * bs + a % bs)
                dst_slots.append(blocks[b // bs] * bs + b % bs)
    if not src_slots:
        return
    first = cache.kv_blocks(0)[0]  # type: ignore[attr-defined]
    index = torch.tensor(src_slots + dst_slots, dtype=torch.long).to(first.device, non_blocking=True)
    src_t, dst_t = index[:len(src_slots)], index[len(src_slots):]
    for layer in range(cache.layout.num_layers):  # type: ignore[attr-defined]
        for pool in cache.kv_blocks(layer):  # type: ignore[attr-defined]
            flat = pool.view(-1, *pool.shape[2:])  # (num_blocks * block_size, KV, Dh)
            flat.index_copy_(0, dst_t, flat.index_select(0, src_t))
