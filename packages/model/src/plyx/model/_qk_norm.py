"""``ProjectionQKNormAttention``: attention with QK-norm over the whole q and k projections (OLMoE).

Qwen3 normalises each head's Dh values (``plyx.attn.Attention(qk_norm=True)``); OLMoE normalises the
full ``[H*Dh]`` query projection and the full ``[KV*Dh]`` key projection before splitting them into
heads (``q_norm.weight [H*Dh]``, ``k_norm.weight [KV*Dh]``), so the statistics span every head.
"""

from __future__ import annotations

from typing import Any

import torch
from plyx.attn import Attention, KVStep, RMSNorm
from plyx.model._model import _kernel

__all__ = ["ProjectionQKNormAttention"]


class ProjectionQKNormAttention(Attention):
    """``Attention`` with OLMoE's QK-norm; same arguments (``qk_norm`` is implied).

    The packed q/k/v decode paths need per-head norms, so static steps take the plain projections here
    (``attend_projected`` returns None because ``q_norm`` is set, and ``forward`` never reads a packed weight).
    """

    def __init__(self, *, norm_eps: float = 1e-6, device: Any = None, dtype: torch.dtype | None = None,
                 **kwargs: Any) -> None:
        kwargs.pop("qk_norm", None)
        super().__init__(qk_norm=False, norm_eps=norm_eps, device=device, dtype=dtype, **kwargs)
        factory = {"device": device, "dtype": dtype}
        self.q_norm = RMSNorm(self.n_heads * self.head_dim, norm_eps, **factory)
        self.k_norm = RMSNorm(self.n_kv_heads * self.head_dim, norm_eps, **factory)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, key_mask: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None, step: KVStep | None = None) -> torch.Tensor:
        """As ``Attention.forward``, with the norms applied to the projections before the head split."""
        B, T, _ = x.shape
        H, KV, Dh = self.n_heads, self.n_kv_heads, self.head_dim
        assert self.q_norm is not None and self.k_norm is not None
        q = self.q_norm(self.q_proj(x)).view(B, T, H, Dh)  # (B, T, H, Dh)
        k = self.k_norm(self.k_proj(x)).view(B, T, KV, Dh)  # (B, T, KV, Dh)
        v = self.v_proj(x).view(B, T, KV, Dh)
        q, k = _kernel("rope_qk", q, k, cos, sin, head_dim=Dh)(q, k, cos, sin)  # one kernel call for both
        if step is None:
            if key_mask is not None:  # the kernels take [B|1, H|1, T, S]: a broadcast view, no copy
                key_mask = key_mask.expand(B, 1, T, key_mask.shape[-1])
            out = _kernel("attention", q, k, v, head_dim=Dh)(
                q, k, v, causal=True, scale=self.scale, mask=key_mask, document_ids=document_ids,
                window=self.sliding_window,
            )
        else:
            out = self._attend_cached(q, k, v, step).to(x.dtype)  # the cache may store another dtype
        return self.o_proj(out.reshape(B, T, H * Dh))  # type: ignore[no-any-return]

    def extra_repr(self) -> str:
        return super().extra_repr() + ", qk_norm_scope=projection"
