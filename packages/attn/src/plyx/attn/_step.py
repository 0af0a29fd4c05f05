"""``KVStep``: what every layer of one forward step needs to talk to a KV cache.

Built once per model forward (``begin_step``): it reserves room for the new
tokens in the cache, works out which of the ``[B, T]`` tokens are real (left
padding is not stored), each sequence's length before and after the step, and
how attention will read the cache (paged kernel or a gathered, left-aligned
copy). The layers then only ``append`` and attend.

Alignment (why left padding works for both read paths): row i has n_i real
tokens at the right end of its T columns and L_i tokens cached after the step.
Gathered keys are left-padded to S = max L_i, so key slot s holds position
s - (S - L_i); query column j holds position L_i - T + j, i.e. key slot
S - T + j. "The queries are the last T of the S keys" thus holds in every row,
which is the bottom-right causal alignment of the ``attention`` kernel; the
padded key slots are masked out by ``key_mask``. ``paged_attention`` reads each
sequence's own ``context_lens[i] = L_i`` and the same alignment holds per row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch
from plyx.specs.kvcache import KVCache

__all__ = ["PAGED_MAX_QUERY", "KVStep", "begin_step", "reserve_tokens"]

#: decode-like steps (at most this many query tokens) use ``paged_attention``
#: on a paged cache; longer ones (prefill chunks) gather keys and use ``attention``
PAGED_MAX_QUERY = 16


@attrs.frozen
class KVStep:
    """Per-step cache bookkeeping, shared by every layer.

    Attributes:
        cache: the cache. seq_ids: its sequence ids, one per batch row.
        token_index: long ``[N]``: flat indices into ``B*T`` of the real tokens, row-major
            (the order ``cache.append`` expects).
        lengths_before: long ``[B]``, tokens cached before this step (the default
            position of each row's first new token).
        lengths_after: host list of lengths after the step.
        paged: ``(block_tables, context_lens)`` when the paged kernel is used, else None.
        key_mask: bool ``[B, 1, 1, S]`` marking real keys of the gathered path (None when no row is padded).
        slots: long ``[B*T]`` for a static step (``plyx.attn.StaticDecode``): the flat slot of each new
            token (row-major) in the cache's ``kv_blocks`` view, written directly (no ``append``, no
            host work), so the step can be captured in a CUDA graph. None: ``append`` as usual.
        varlen: a packed step's attention groups (``plyx.attn.begin_packed_step``): the batch is one row of
            ``N`` tokens from several sequences, written through ``slots`` and attended group by group
            through the paged kernel. None: rows are sequences.
    """

    cache: KVCache
    seq_ids: tuple[int, ...]
    token_index: torch.Tensor | None
    lengths_before: torch.Tensor
    lengths_after: tuple[int, ...]
    paged: tuple[torch.Tensor, torch.Tensor] | None
    key_mask: torch.Tensor | None
    slots: torch.Tensor | None = None
    varlen: tuple[Any, ...] | None = None
    #: kernels chosen for this step, by (name, shape key): every layer of a step attends the same shapes, so the
    #: registry is asked once per step instead of once per layer (``kernel_for``)
    kernels: dict[Any, Any] = attrs.field(factory=dict, eq=False, repr=False)

    def kernel_for(self, name: str, key: Any, *tensors: torch.Tensor, **shape: int) -> Any:
        """``plyx.attn`` kernel ``name`` for ``tensors``, looked up once per step and ``key`` (the same shapes
        and dtypes in every layer) instead of once per layer."""
        fn = self.kernels.get((name, key))
        if fn is None:
            from plyx.attn._kernels import kernel

            fn = self.kernels[(name, key)] = kernel(name, *tensors, **shape)
        return fn

    def pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s keys and values as ``[num_blocks, block_size, KV, Dh]``, the layout ``paged_attention`` reads."""
        if self.slots is not None:
            return self.cache.kv_blocks(layer)  # type: ignore[attr-defined]
        return self.cache.kv_pool(layer)  # type: ignore[return-value]

    def scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A quantised cache's scale pools of ``layer`` (``[num_blocks, block_size, KV]`` float32), else None."""
        fn = getattr(self.cache, "kv_scales", None)
        return None if fn is None else fn(layer)  # type: ignore[no-any-return]

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append the real tokens of ``k``, ``v`` (``[B, T, KV, Dh]``) to ``layer``."""
        kv = k.shape[2:]
        k_flat, v_flat = k.reshape(-1, *kv), v.reshape(-1, *kv)  # (B*T, KV, Dh)
        write = getattr(self.cache, "write_slots", None) if self.slots is not None else None
        if write is not None:  # a quantised cache: its own kernel quantises into the slots
            write(layer, self.slots, k_flat, v_flat)
            return
        if self.slots is not None:
            k_pool, v_pool = self.pools(layer)
            k_pool.view(-1, *kv).index_copy_(0, self.slots, k_flat.to(k_pool.dtype))
            v_pool.view(-1, *kv).index_copy_(0, self.slots, v_flat.to(v_pool.dtype))
            return
        if self.token_index is not None:
            k_flat, v_flat = k_flat.index_select(0, self.token_index), v_flat.index_select(0, self.token_index)
        self.cache.append(layer, self.seq_ids, k_flat, v_flat)

    def gather(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every cached key and value of the batch, left-padded: two ``[B, S, KV, Dh]``."""
        reads = [self.cache.read(layer, s) for s in self.seq_ids]
        S = max(self.lengths_after)
        first = reads[0][0]
        k = first.new_zeros((len(reads), S, *first.shape[1:]))
        v = torch.zeros_like(k)
        for row, (rk, rv) in enumerate(reads):
            n = rk.shape[0]
            if n:
                k[row, S - n :] = rk
                v[row, S - n :] = rv
        return k, v


def reserve_tokens(cache: Any, seq_ids: Sequence[int], counts: Sequence[int]) -> None:
    """Allocate the sequences of ``seq_ids`` the cache does not hold yet and reserve ``counts[i]`` new tokens for
    each, all or nothing: if the reserve fails (``CacheFullError``), the sequences it allocated are evicted and the
    cache is left exactly as it was."""
    live = set(cache.sequences())
    new = [s for s in seq_ids if s not in live]
    for s in new:
        cache.allocate(s)
    try:
        cache.reserve(seq_ids, counts)
    except BaseException:
        for s in new:
            cache.evict(s)
        raise


def begin_step(
    cache: KVCache,
    seq_ids: Sequence[int] | None,
    batch: int,
    steps: int,
    attention_mask: torch.Tensor | None,
    device: torch.device,
) -> KVStep:
    """Reserve the new tokens of a ``[batch, steps]`` input and plan how layers read the cache.

    Sequences not yet in the cache are allocated. ``attention_mask`` (``[B, T]``,
    1 = real token) must be left padding: zeros, then ones. The reserve is all
    or nothing (``CacheFullError`` leaves the cache as it was).
    """
    ids = tuple(range(batch)) if seq_ids is None else tuple(int(s) for s in seq_ids)
    if len(ids) != batch:
        raise ValueError(f"seq_ids has {len(ids)} ids for a batch of {batch} rows; pass one id per row of input_ids")
    if attention_mask is not None:
        mask = attention_mask.to(torch.bool)
        if tuple(mask.shape) != (batch, steps):
            raise ValueError(f"attention_mask has shape {list(mask.shape)}, expected [B, T] = [{batch}, {steps}]")
        # left padding: once a row turns real it stays real (no holes, no right padding)
        if bool((mask[:, :-1] & ~mask[:, 1:]).any()):
            raise ValueError(
                "attention_mask must mark left padding (0s then 1s in every row) when a cache is used; "
                "right-padded or holed rows would store padding in the cache. Left-pad the batch instead"
            )
        counts = mask.sum(dim=1).tolist()
    else:
        mask = None
        counts = [steps] * batch
    live = set(cache.sequences())
    before = [cache.length(s) if s in live else 0 for s in ids]
    reserve_tokens(cache, ids, counts)
    after = tuple(b + n for b, n in zip(before, counts))
    token_index = None
    if mask is not None and not bool(mask.all()):
        token_index = mask.reshape(-1).nonzero().squeeze(1).to(device)
    paged = None
    key_mask = None
    table = cache.block_table(ids) if steps <= PAGED_MAX_QUERY else None
    if table is not None and min(after) >= steps:
        paged = (table.block_tables.to(device), table.context_lens.to(device))
    else:
        S = max(after)
        if min(after) != S:
            lens = torch.tensor(after, device=device)
            key_mask = (torch.arange(S, device=device)[None, :] >= (S - lens)[:, None])[:, None, None, :]
    return KVStep(
        cache=cache,
        seq_ids=ids,
        token_index=token_index,
        lengths_before=torch.tensor(before, dtype=torch.long, device=device),
        lengths_after=after,
        paged=paged,
        key_mask=key_mask,
    )
