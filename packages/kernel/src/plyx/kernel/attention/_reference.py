"""Pure-torch reference attention: the specification every other backend must match.

Materialises the [B, H, T, S] score matrix, so it is for checking and for
small problems only. It runs on any device and dtype; half-precision inputs are
computed in float32 and cast back, float64 stays float64 (``gradcheck``).

Math (per batch b, head h, query i, key j; g = H // KV is the GQA group)::

    s[i, j]  = scale * q[i, h] . k[j, h // g]            (+ additive mask)
    allowed  = causal:   j <= i + (S - T)                 (bottom-right alignment)
               window:   (i + S - T) - j < window
               docs:     doc[i] == doc[j]
               bool mask[i, j]
    lse[i]   = log sum_{j allowed} exp(s[i, j])           (-inf when nothing is allowed)
    o[i]     = sum_j exp(s[i, j] - lse[i]) v[j, h // g]   (0 when nothing is allowed)
"""

from __future__ import annotations

import torch
from plyx.kernel.attention._checks import check_attention, check_paged, check_paged_quant

__all__ = ["allowed_mask", "attention_reference", "attention_reference_backward", "attention_reference_saving",
           "paged_attention_per_sequence", "paged_attention_quant_reference",
           "paged_attention_reference"]


def allowed_mask(
    T: int,
    S: int,
    *,
    causal: bool,
    window: int | None,
    document_ids: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor | None:
    """The structural mask as bool [B|1, 1, T, S] (True = attend), or None when everything is allowed."""
    if not causal and window is None and document_ids is None:
        return None
    q_pos = torch.arange(S - T, S, device=device)[:, None]  # (T, 1): queries are the last T positions
    k_pos = torch.arange(S, device=device)[None, :]  # (1, S)
    allowed = torch.ones(T, S, dtype=torch.bool, device=device)
    if causal:
        allowed &= k_pos <= q_pos
    if window is not None:
        allowed &= (q_pos - k_pos) < window
    allowed = allowed[None, None]  # (1, 1, T, S)
    if document_ids is not None:
        docs = document_ids.to(device)
        allowed = allowed & (docs[:, None, :, None] == docs[:, None, None, :])  # (B, 1, T, S)
    return allowed


def _scores(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float | None,
            mask: torch.Tensor | None, document_ids: torch.Tensor | None, window: int | None) -> tuple[
                torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """``(qh, kh, vh, scores, scale)``: heads-first q, k and v in the compute dtype (k and v repeated to H
    heads) and the masked scores ``[B, H, T, S]`` (-inf where not allowed)."""
    a = check_attention(q, k, v, scale=scale, mask=mask, document_ids=document_ids, window=window)
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    group = a.H // a.KV
    qh = q.transpose(1, 2).to(compute)  # (B, H, T, Dh)
    kh = k.transpose(1, 2).to(compute).repeat_interleave(group, dim=1)  # (B, H, S, Dh)
    vh = v.transpose(1, 2).to(compute).repeat_interleave(group, dim=1)  # (B, H, S, Dh)
    scores = (qh @ kh.transpose(-1, -2)) * a.scale  # (B, H, T, S)
    allowed = allowed_mask(a.T, a.S, causal=causal, window=window, document_ids=document_ids, device=q.device)
    if mask is not None:
        if mask.dtype == torch.bool:
            allowed = mask if allowed is None else allowed & mask
        else:
            scores = scores + mask.to(compute)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return qh, kh, vh, scores, a.scale


def attention_reference_saving(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                               scale: float | None = None, mask: torch.Tensor | None = None,
                               document_ids: torch.Tensor | None = None,
                               window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, lse)``: the reference forward and its log-sum-exp ``[B, H, T]`` in the compute dtype (float64 for
    float64 inputs, else float32; -inf on empty rows), what ``attention_reference_backward`` needs.

    ``plyx::attention``'s custom op saves these instead of re-running the forward in its backward.
    """
    _, _, vh, scores, _ = _scores(q, k, v, causal=causal, scale=scale, mask=mask, document_ids=document_ids,
                                  window=window)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # (B, H, T, 1); -inf on empty rows
    # empty rows: p = 0 and o = 0 (exp(-inf - 0)), as attention_reference gives
    p = torch.exp(scores - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)))
    o = (p @ vh).transpose(1, 2).to(q.dtype)  # (B, T, H, Dh)
    return o, lse.squeeze(-1)


def attention_reference_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 o: torch.Tensor, lse: torch.Tensor, *, causal: bool = True,
                                 scale: float | None = None, mask: torch.Tensor | None = None,
                                 document_ids: torch.Tensor | None = None,
                                 window: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` from the saved ``o`` and ``lse`` (FlashAttention's backward, in plain torch)::

        p = exp(s - lse)    dv = p^T do    dp = do v^T    ds = p * (dp - rowsum(do * o))
        dq = scale * ds k   dk = scale * ds^T q           (k, v summed over each GQA group)
    """
    qh, kh, vh, scores, sc = _scores(q, k, v, causal=causal, scale=scale, mask=mask, document_ids=document_ids,
                                     window=window)
    compute = qh.dtype
    B, H, T, _ = qh.shape
    KV, S = k.shape[2], k.shape[1]
    lse_c = lse.to(compute)[..., None]  # (B, H, T, 1)
    # empty rows (lse = -inf) have p = 0 (their o is 0, and so is every gradient through them)
    p = torch.where(torch.isfinite(lse_c), torch.exp(scores - torch.where(torch.isfinite(lse_c), lse_c, 0.0)), 0.0)
    doh = do.transpose(1, 2).to(compute)  # (B, H, T, Dh)
    oh = o.transpose(1, 2).to(compute)
    dvh = p.transpose(-1, -2) @ doh  # (B, H, S, Dh)
    dp = doh @ vh.transpose(-1, -2)  # (B, H, T, S)
    ds = p * (dp - (doh * oh).sum(-1, keepdim=True))
    dq = (ds @ kh) * sc  # (B, H, T, Dh)
    dkh = (ds.transpose(-1, -2) @ qh) * sc  # (B, H, S, Dh)
    group = H // KV
    # (B, H, S, Dh) -> (B, KV, group, S, Dh): head h reads key/value head h // group
    dk = dkh.view(B, KV, group, S, -1).sum(2)
    dv = dvh.view(B, KV, group, S, -1).sum(2)
    return (dq.transpose(1, 2).to(q.dtype), dk.transpose(1, 2).to(k.dtype), dv.transpose(1, 2).to(v.dtype))


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
    window: int | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention, the plyx ``attention`` contract, in plain torch.

    Args:
        q: [B, T, H, Dh] queries; the last T of the S key positions.
        k, v: [B, S, KV, Dh]; H must be a multiple of KV (GQA/MQA).
        causal: mask keys after each query (bottom-right aligned when T < S).
        scale: softmax scale, default Dh ** -0.5.
        mask: bool [B|1, H|1, T|1, S] (True = attend; [B, 1, 1, S] is a key-padding mask) or additive float mask.
        document_ids: [B, T] ids of packed documents (T == S); no attention across them.
        window: sliding window; keys with q_pos - k_pos >= window are masked.
        return_lse: also return the log-sum-exp [B, H, T] in float32.

    Returns:
        o [B, T, H, Dh] in q's dtype (rows with nothing to attend to are 0),
        and lse [B, H, T] float32 when ``return_lse``.

    Example:
        >>> q = torch.randn(1, 5, 4, 8); k = v = torch.randn(1, 5, 2, 8)
        >>> attention_reference(q, k, v).shape
        torch.Size([1, 5, 4, 8])
    """
    qh, kh, vh, scores, _ = _scores(q, k, v, causal=causal, scale=scale, mask=mask, document_ids=document_ids,
                                    window=window)
    # Softmax written out so that rows with nothing allowed give exactly 0 (and
    # finite gradients) instead of the NaN of softmax over all -inf.
    row_max = scores.amax(dim=-1, keepdim=True).detach()  # (B, H, T, 1)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    e = torch.exp(scores - row_max)  # exp(-inf) = 0 for masked keys
    total = e.sum(dim=-1, keepdim=True)
    p = e / torch.where(total > 0, total, torch.ones_like(total))
    o = (p @ vh).transpose(1, 2).to(q.dtype)  # (B, T, H, Dh)
    if not return_lse:
        return o
    lse = (row_max + torch.log(total)).squeeze(-1)  # (B, H, T); -inf for empty rows
    return o, lse.to(torch.float32)


def paged_attention_reference(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of a few new tokens per sequence against a paged KV cache, in plain torch.

    Args:
        q: [B, Tq, H, Dh]; the last Tq positions of each sequence (causal among themselves).
        k_pool, v_pool: [num_blocks, block_size, KV, Dh], the cache's pools.
        block_tables: int32 [B, max_blocks]; entry j holds tokens j*block_size ... of the sequence.
        context_lens: int32 [B], tokens stored per sequence, the Tq new ones included.
        scale: softmax scale, default Dh ** -0.5.
        window: sliding window as in ``attention``.

    Returns:
        o [B, Tq, H, Dh] in q's dtype.

    Batched: every sequence's blocks are gathered at once into [B, S_max, KV, Dh]
    (``index_select`` on the pool with the flattened block table), one mask holds
    causality among the new tokens, the lengths and the window, and one attention
    runs with the queries of each kv head grouped as [B, KV, group*Tq, Dh], so
    K/V are never repeated per query head. One host sync (the longest length), none while a CUDA graph is
    captured (the whole table is gathered then).
    """
    B, Tq, H, KV, D, block_size = check_paged(q, k_pool, v_pool, block_tables, context_lens)
    if window is not None and window < 1:
        raise ValueError(f"paged_attention: `window` must be >= 1 (keys with q_pos - k_pos >= window are masked), "
                         f"got {window}")
    lens = context_lens.to(device=q.device, dtype=torch.long)  # (B,)
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    group = H // KV
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        # inside a CUDA graph no value reaches the host: the whole table is gathered (the masks below hide every
        # key past a sequence's length) and the lengths go unchecked, so a float32 engine's steps capture too
        n_blocks = block_tables.shape[1]
    else:
        n_blocks = _checked_blocks(lens, Tq, block_size, block_tables.shape[1])
    S = n_blocks * block_size  # every sequence padded to the longest one's blocks
    # Gather through the block table. Entries past a sequence's own blocks are not part of the
    # contract (0 by convention), so they are replaced by block 0: read, then masked out below.
    table = block_tables[:, :n_blocks].to(device=k_pool.device, dtype=torch.long)  # (B, n_blocks)
    owned = torch.arange(n_blocks, device=table.device) * block_size < lens.to(table.device)[:, None]
    flat = torch.where(owned, table, torch.zeros_like(table)).reshape(-1)
    k = k_pool.index_select(0, flat).view(B, S, KV, D).transpose(1, 2).to(compute)  # (B, KV, S, Dh)
    v = v_pool.index_select(0, flat).view(B, S, KV, D).transpose(1, 2).to(compute)  # (B, KV, S, Dh)
    # GQA without repeating K/V: the `group` query heads of one kv head form one row block.
    qg = q.to(compute).view(B, Tq, KV, group, D).permute(0, 2, 3, 1, 4).reshape(B, KV, group * Tq, D)
    scores = (qg @ k.transpose(-1, -2)).view(B, KV, group, Tq, S) * (D**-0.5 if scale is None else scale)
    # Query i of sequence b sits at position lens[b] - Tq + i; causal masking also hides the padding
    # (every allowed key is at or before a query, hence before lens[b]).
    q_pos = (lens[:, None] - Tq + torch.arange(Tq, device=q.device))[:, :, None]  # (B, Tq, 1)
    k_pos = torch.arange(S, device=q.device)  # (S,)
    allowed = k_pos <= q_pos  # (B, Tq, S)
    if window is not None:
        allowed &= (q_pos - k_pos) < window
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    # Every row keeps at least its own key (lens >= Tq, window >= 1), so no row is all -inf. The
    # softmax is written out: torch.softmax wakes the intra-op thread pool even for tiny inputs,
    # which costs a scheduler slice per call on a loaded CPU (20 ms measured on 2 busy cores).
    e = torch.exp(scores - scores.amax(dim=-1, keepdim=True).detach())
    p = (e / e.sum(dim=-1, keepdim=True)).view(B, KV, group * Tq, S)
    o = (p @ v).view(B, KV, group, Tq, D).permute(0, 3, 1, 2, 4).reshape(B, Tq, H, D)
    return o.to(q.dtype)


def _checked_blocks(lens: torch.Tensor, Tq: int, block_size: int, columns: int) -> int:
    """Blocks of the longest sequence, after checking every length holds the Tq new tokens and fits the table
    (one host sync)."""
    B = lens.shape[0]
    shortest, longest = torch.stack(torch.aminmax(lens)).tolist() if B else (Tq, Tq)
    if shortest < Tq:
        b = int(torch.nonzero(lens < Tq)[0, 0])
        raise ValueError(
            f"paged_attention: context_lens[{b}]={int(lens[b])} is smaller than Tq={Tq}; context_lens counts the "
            f"new query tokens too, so reserve them in the cache before attending"
        )
    n_blocks = -(-longest // block_size)
    if n_blocks > columns:
        raise ValueError(
            f"paged_attention: `block_tables` has {columns} columns but context_lens holds up to "
            f"{longest} tokens, which take {n_blocks} blocks of {block_size}; pass a table wide enough for the "
            f"longest sequence (cache.block_table(seq_ids))"
        )
    return n_blocks


def paged_attention_per_sequence(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                                 block_tables: torch.Tensor, context_lens: torch.Tensor, *,
                                 scale: float | None = None, window: int | None = None) -> torch.Tensor:
    """The paged-attention contract one sequence at a time: gather its blocks, then dense attention.

    Slow and plainly right: the oracle the batched reference is checked against, and the "before"
    side of its CPU benchmark.
    """
    block_size, KV, D = k_pool.shape[1], k_pool.shape[2], k_pool.shape[3]
    out = []
    for b, length in enumerate(context_lens.tolist()):
        n_blocks = -(-length // block_size)
        blocks = block_tables[b, :n_blocks].long()
        k = k_pool[blocks].reshape(n_blocks * block_size, KV, D)[:length]
        v = v_pool[blocks].reshape(n_blocks * block_size, KV, D)[:length]
        out.append(attention_reference(q[b : b + 1], k[None], v[None], causal=True, scale=scale, window=window))
    return torch.cat(out, dim=0)


def paged_attention_quant_reference(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Paged decode attention over a quantised cache: ``paged_attention`` of the dequantised keys and values.

    Args:
        q: [B, Tq, H, Dh], a float dtype (the model's).
        k_pool, v_pool: int8 or float8_e4m3fn [num_blocks, block_size, KV, Dh].
        k_scale, v_scale: float32 [num_blocks, block_size, KV]: token n of a block holds
            ``k_pool[blk, n].float() * k_scale[blk, n, :, None]`` (``plyx.kernel.reference.store_kv_quant``).
        block_tables, context_lens, scale, window: as in ``paged_attention_reference``.

    Returns:
        o [B, Tq, H, Dh] in q's dtype.

    Only the blocks the tables name (up to the longest sequence) are dequantised, into a compact pool
    of float32 (float64 when q is float64), which ``paged_attention_reference`` then reads.
    """
    B, Tq, H, KV, D, block_size = check_paged_quant(q, k_pool, v_pool, k_scale, v_scale, block_tables, context_lens)
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    lens = context_lens.to(device=q.device, dtype=torch.long)
    longest = int(lens.max()) if B else Tq  # one host sync
    n_blocks = max(1, min(-(-longest // block_size), block_tables.shape[1]))
    table = block_tables[:, :n_blocks].to(device=k_pool.device, dtype=torch.long)  # (B, n_blocks)
    flat = table.reshape(-1)

    def gather(pool: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
        raw = pool.view(torch.uint8) if pool.dtype == torch.float8_e4m3fn else pool  # no float8 index_select on CPU
        blocks = raw.index_select(0, flat).view(pool.dtype)  # (B*n_blocks, block_size, KV, Dh)
        return blocks.to(compute) * sc.index_select(0, flat).to(compute)[..., None]

    compact = torch.arange(B * n_blocks, device=k_pool.device, dtype=torch.int32).view(B, n_blocks)
    out = paged_attention_reference(q.to(compute), gather(k_pool, k_scale), gather(v_pool, v_scale), compact,
                                    context_lens, scale=scale, window=window)
    return out.to(q.dtype)
