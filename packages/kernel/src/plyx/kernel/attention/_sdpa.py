"""``attention`` through ``torch.nn.functional.scaled_dot_product_attention``.

The registry's portable fast path: torch picks its own backend (flash, cuDNN,
memory-efficient or math). Everything SDPA cannot express directly is turned
into a boolean mask: bottom-right causal alignment when T < S, sliding windows,
packed documents. SDPA does not return the log-sum-exp, so ``return_lse=True``
is answered by the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from plyx.kernel.attention._checks import check_attention
from plyx.kernel.attention._reference import allowed_mask, attention_reference

__all__ = ["attention_sdpa"]


def attention_sdpa(
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
    """The ``attention`` contract (see ``attention_reference``) on torch SDPA."""
    if return_lse:
        return attention_reference(
            q, k, v, causal=causal, scale=scale, mask=mask, document_ids=document_ids, window=window, return_lse=True
        )
    a = check_attention(q, k, v, scale=scale, mask=mask, document_ids=document_ids, window=window)
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H|KV, T|S, Dh)
    # SDPA's is_causal is top-left aligned; use it only where that is the same thing.
    plain_causal = causal and a.T == a.S and window is None and document_ids is None and mask is None
    attn_mask = None
    if not plain_causal:
        attn_mask = allowed_mask(a.T, a.S, causal=causal, window=window, document_ids=document_ids, device=q.device)
    empty_rows = None
    if mask is not None:
        if mask.dtype == torch.bool:
            attn_mask = mask if attn_mask is None else attn_mask & mask
        else:
            additive = mask.to(q.dtype)
            if attn_mask is not None:
                additive = additive.masked_fill(~attn_mask, float("-inf"))
            attn_mask = additive
        # Only a user mask can leave a row with nothing to attend to (the causal
        # diagonal, the window and the own document always allow one key).
        allowed = attn_mask if attn_mask.dtype == torch.bool else ~torch.isneginf(attn_mask)
        empty_rows = ~allowed.any(dim=-1, keepdim=True)  # (B|1, H|1, T, 1)
    if a.H != a.KV:
        try:
            o = F.scaled_dot_product_attention(
                qh, kh, vh, attn_mask=attn_mask, is_causal=plain_causal, scale=a.scale, enable_gqa=True
            )
        except TypeError:  # torch < 2.5 has no enable_gqa: repeat the key/value heads
            group = a.H // a.KV
            kh, vh = kh.repeat_interleave(group, dim=1), vh.repeat_interleave(group, dim=1)
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=attn_mask, is_causal=plain_causal, scale=a.scale)
    else:
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=attn_mask, is_causal=plain_causal, scale=a.scale)
    if empty_rows is not None:
        o = torch.where(empty_rows, torch.zeros((), dtype=o.dtype, device=o.device), o)
    return o.transpose(1, 2)  # (B, T, H, Dh)
