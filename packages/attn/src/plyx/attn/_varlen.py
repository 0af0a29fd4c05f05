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
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
from plyx.attn._decode import supports_static_decode
from plyx.attn._step import KVStep, reserve_tokens
from plyx.specs.kvcache import KVCache

__all__ = ["VarlenGroup", "begin_packed_step", "varlen_groups"]


@attrs.frozen
class VarlenGroup:
    """Consecutive rows of a packed step that feed the same number of tokens.

    Attributes:
        start: index of the group's first token in the flat ``[N]`` batch.
        rows: sequences in the group. query_len: tokens each feeds (its ``rows * query_len`` tokens follow
            ``start`` row by row).
        block_tables: int32 ``[rows, W]``; context_lens: int32 ``[rows]``, tokens cached after the step
            (the new ones included), as ``paged_attention`` reads them.
    """

    start: int
    rows: int
    query_len: int
    block_tables: torch.Tensor
    context_lens: torch.Tensor


def varlen_groups(counts: Sequence[int]) -> list[tuple[int, int, int, int]]:
    """Maximal runs of equal counts: ``(first row, rows, count, first token)`` each, in order."""
    runs: list[tuple[int, int, int, int]] = []
    token = 0
    for i, n in enumerate(counts):
        if runs and runs[-1][2] == n and runs[-1][0] + runs[-1][1] == i:
            first, rows, _, start = runs[-1]
            runs[-1] = (first, rows + 1, n, start)
        else:
            runs.append((i, 1, n, token))
        token += n
    return runs


def begin_packed_step(cache: KVCache, seq_ids: Sequence[int], counts: Sequence[int],
                      tokens: Sequence[int] | torch.Tensor, device: torch.device,
                      ) -> tuple[torch.Tensor, torch.Tensor, KVStep]:
    """Reserve ``counts[i]`` tokens for each of ``seq_ids`` and plan one packed forward over them.

    Args:
        cache: a block-addressable cache; unknown ``seq_ids`` are allocated.
        seq_ids: one per row, each once. counts: new tokens per row (>= 1).
        tokens: the ``sum(counts)`` new token ids, row after row: host ints, or a ``[N]`` tensor already on
            ``device`` (tokens sampled there: no round trip through the host).
        device: where the model runs.

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
    reserve_tokens(cache, ids, counts)
    bs = int(cache.block_size)  # type: ignore[attr-defined]
    positions: list[int] = []
    slots: list[int] = []
    rows: list[list[int]] = []
    ends: list[int] = []
    for sid, n in zip(ids, counts):
        blocks = cache.seq_blocks(sid)  # type: ignore[attr-defined]
        end = cache.length(sid)
        rows.append(list(blocks[:-(-end // bs)]))
        ends.append(end)
        for p in range(end - n, end):
            positions.append(p)
            slots.append(blocks[p // bs] * bs + p % bs)
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
    groups = tuple(VarlenGroup(start, rows, n, tables[first:first + rows], lens[first:first + rows])
                   for first, rows, n, start in varlen_groups(counts))
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
