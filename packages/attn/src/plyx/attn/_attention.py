"""``Attention``: multi-head attention with GQA/MQA, QK-norm and RoPE, kernels resolved by name.

Shapes: x ``[B, T, D]``; q ``[B, T, H, Dh]``; k, v ``[B, T, KV, Dh]`` with
``H % KV == 0`` (MHA: KV = H, GQA: 1 < KV < H, MQA: KV = 1).

Masks, all handled by the ``attention`` kernel: causal always; padding through
``key_mask`` (bool ``[B, 1, 1, S]``, True = real key); packed documents through
``document_ids`` (``[B, T]``, no attention across documents); sliding window
(Mistral: a query sees itself and the ``window - 1`` keys before it).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from plyx.attn._kernels import kernel
from plyx.attn._norm import RMSNorm
from plyx.attn._packing import pack_linears_, packed_for_inference, stacked_for_training
from plyx.attn._step import KVStep
from plyx.specs.kernels import KernelNotFoundError
from torch import nn

__all__ = ["Attention"]


class Attention(nn.Module):
    """Self-attention of one decoder layer.

    Args:
        d_model: width of the residual stream.
        n_heads, n_kv_heads, head_dim: H, KV and Dh.
        qkv_bias: biases on q/k/v (Qwen2).
        qk_norm: RMSNorm over Dh on each head's q and k before RoPE (Qwen3).
        norm_eps: epsilon of the QK-norm.
        sliding_window: attend to at most this many positions (the query's included); None = full causal.
        layer_idx: which cache layer this module writes.

    Parameters (Hugging Face names, so state dicts map one to one):
        ``q_proj [H*Dh, D]``, ``k_proj``/``v_proj [KV*Dh, D]``, ``o_proj [D, H*Dh]``,
        ``q_norm.weight``/``k_norm.weight [Dh]`` when ``qk_norm``.
    """

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        qkv_bias: bool = False,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        sliding_window: int | None = None,
        layer_idx: int = 0,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads ({n_kv_heads}) must divide n_heads ({n_heads}); use 1 (MQA) .. n_heads (MHA)")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.sliding_window = sliding_window
        self.layer_idx = layer_idx
        self.norm_eps = norm_eps
        self.scale = head_dim**-0.5
        factory = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=qkv_bias, **factory)
        self.k_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=qkv_bias, **factory)
        self.v_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=qkv_bias, **factory)
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=False, **factory)
        if qk_norm:
            self.q_norm: RMSNorm | None = RMSNorm(head_dim, norm_eps, **factory)
            self.k_norm: RMSNorm | None = RMSNorm(head_dim, norm_eps, **factory)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        key_mask: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        step: KVStep | None = None,
    ) -> torch.Tensor:
        """Attend over ``x`` (and the cache, when ``step`` is given).

        Args:
            x: ``[B, T, D]``.
            cos, sin: RoPE tables ``[T, R/2]`` or ``[B, T, R/2]`` (R <= Dh: partial rotary).
            key_mask: bool ``[B, 1, 1, T]``, True for real tokens (no-cache padding).
            document_ids: ``[B, T]`` packed documents (no cache).
            step: the cache step from ``begin_step``; keys and values are stored and
                attention reads every cached token of each sequence.

        Returns:
            ``[B, T, D]``.
        """
        B, T, _ = x.shape
        packed = packed_for_inference((self.q_proj, self.k_proj, self.v_proj)) if step is not None and step.slots is not None else None
        if packed is not None:
            qkv = F.linear(x, *packed).view(B, T, self.n_heads + 2 * self.n_kv_heads, self.head_dim)
            out = self.attend_projected(qkv, cos, sin, step)  # type: ignore[arg-type]
            if out is not None:
                return out
            q, k, v = self._rotate_packed(qkv, cos, sin)  # QK-norm or no rope_store_kv: the same projection
        else:
            H, KV, Dh = self.n_heads, self.n_kv_heads, self.head_dim
            pairs = self.q_norm is None and 2 * cos.shape[-1] == Dh  # RoPE over whole heads, no QK-norm
            stacked = None if step is not None else stacked_for_training(
                (self.q_proj, self.k_proj, self.v_proj), x, arrange=partial(_pairs_of_qk, Dh) if pairs else None)
            if stacked is not None:  # a CPU training step: one GEMM, the heads split off as views
                q, k, v = self._rotate_trained(F.linear(x, *stacked).view(B, T, H + 2 * KV, Dh), cos, sin, pairs)
            else:
                q = self.q_proj(x).view(B, T, H, Dh)  # (B, T, H, Dh)
                k = self.k_proj(x).view(B, T, KV, Dh)  # (B, T, KV, Dh)
                v = self.v_proj(x).view(B, T, KV, Dh)
                if self.q_norm is not None and self.k_norm is not None:
                    q, k = self.q_norm(q), self.k_norm(k)
                # q and k rotated in one kernel call (one launch on CUDA, whatever their head counts)
                q, k = kernel("rope_qk", q, k, cos, sin, head_dim=Dh)(q, k, cos, sin)
        if step is None:
            if key_mask is not None:  # the kernels take [B|1, H|1, T, S]: a broadcast view, no copy
                key_mask = key_mask.expand(B, 1, T, key_mask.shape[-1])
            out = kernel("attention", q, k, v, head_dim=self.head_dim)(
                q, k, v, causal=True, scale=self.scale, mask=key_mask, document_ids=document_ids,
                window=self.sliding_window,
            )
        else:
            out = self._attend_cached(q, k, v, step).to(x.dtype)  # the cache may store another dtype
        return self.o_proj(out.reshape(B, T, self.n_heads * self.head_dim))

    # -- packed q/k/v (static decode steps; see plyx.attn.pack_linears_) ------------------
    def pack_projections_(self) -> None:
        """Stack the q, k and v weights in one buffer (same parameters and values): one GEMV per decode step."""
        pack_linears_((self.q_proj, self.k_proj, self.v_proj))


    def _rotate_trained(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairs: bool
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of a training step's stacked projection ``[B, T, H + 2 KV, Dh]`` (``stacked_for_training``),
        q and k normed (QK-norm) and rotated, each split off as a view (a split's backward is one concatenation).

        ``pairs``: the stacked weight's q and k rows were reordered per head from the rotate-half layout
        ``(a_0 .. a_{Dh/2-1}, b_0 .. b_{Dh/2-1})`` to pairs ``(a_0, b_0, a_1, b_1, ..)`` (``_pairs_of_qk``), so
        RoPE is the interleaved one: on CPU one complex product over q and k together, each way (nanoGPT's CPU
        recipe, issue 20). q and k then hold their dims in one other order, the same for both: every score
        ``q . k`` is the same sum, and v, hence the output, keeps its layout.
        """
        H, KV, Dh = self.n_heads, self.n_kv_heads, self.head_dim
        if pairs:
            qk, v = qkv.split((H + KV, KV), dim=2)  # (B, T, H + KV, Dh), (B, T, KV, Dh)
            rotated = kernel("rope", qk, cos, sin, head_dim=Dh)(qk, cos, sin, interleaved=True)
            q, k = rotated.split((H, KV), dim=2)
            return q, k, v
        q, k, v = qkv.split((H, KV, KV), dim=2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = kernel("rope_qk", q, k, cos, sin, head_dim=Dh)(q, k, cos, sin)
        return q, k, v

    def _rotate_packed(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of one packed GEMV's output ``[B, T, H + 2 KV, Dh]``, q and k normed (QK-norm) and rotated;
        without QK-norm, RoPE turns q and k in one launch (they are adjacent)."""
        H, KV, Dh = self.n_heads, self.n_kv_heads, self.head_dim
        v = qkv[:, :, H + KV:]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(qkv[:, :, :H]), self.k_norm(qkv[:, :, H:H + KV])
            q, k = kernel("rope_qk", q, k, cos, sin, head_dim=Dh)(q, k, cos, sin)
            return q, k, v
        qk = qkv[:, :, :H + KV]
        qk = kernel("rope", qk, cos, sin, head_dim=Dh)(qk, cos, sin)  # (B, T, H + KV, Dh)
        return qk[:, :, :H], qk[:, :, H:], v

    def _rope_and_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: KVStep) -> torch.Tensor | None:
        """q rotated; k rotated and v written to the step's slots (one ``rope_store_kv`` launch); None: no such kernel."""
        H, KV, Dh = self.n_heads, self.n_kv_heads, self.head_dim
        scales = step.scales(self.layer_idx)
        k_pool, v_pool = step.pools(self.layer_idx)  # (num_blocks, block_size, KV, Dh) each
        if scales is not None:  # a quantised cache: k and v quantised into its pools in the same launch
            try:
                fn = kernel("rope_store_kv_quant", qkv, cos, sin, head_dim=Dh)
            except KernelNotFoundError:  # an older plyx-kernel: RoPE, then the cache's quantising store
                q, k, v = self._rotate_packed(qkv, cos, sin)
                step.store(self.layer_idx, k, v)
                return q
            k_scale, v_scale = scales  # (num_blocks, block_size, KV) each
            return fn(qkv, cos, sin, k_pool.view(-1, KV, Dh), v_pool.view(-1, KV, Dh),  # type: ignore[no-any-return]
                      k_scale.view(-1, KV), v_scale.view(-1, KV), step.slots, n_heads=H, n_kv_heads=KV)
        try:
            fn = kernel("rope_store_kv", qkv, cos, sin, head_dim=Dh)
        except KernelNotFoundError:
            return None
        return fn(qkv, cos, sin, k_pool.view(-1, KV, Dh), v_pool.view(-1, KV, Dh), step.slots,  # type: ignore[no-any-return]
                  n_heads=H, n_kv_heads=KV)

    def attend_projected(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: KVStep) -> torch.Tensor | None:
        """The rest of a static step after the packed q/k/v projection (computed by the caller, e.g. fused with
        the layer's RMSNorm): RoPE and cache writes, paged attention, ``o_proj``. ``qkv`` is ``[B, T, H + 2 KV, Dh]``.

        Returns ``[B, T, D]``, or None when that path is not available (QK-norm, or no ``rope_store_kv``
        kernel): the caller then runs ``forward``.
        """
        if self.q_norm is not None or (step.paged is None and step.varlen is None):
            return None
        q = self._rope_and_store(qkv, cos, sin, step)
        if q is None:
            return None
        B, T = qkv.shape[:2]
        out = self._attend_varlen(q, step) if step.varlen is not None else self._attend_paged(q, step)
        return self._project_out(out.to(qkv.dtype).reshape(B, T, self.n_heads * self.head_dim))

    def _project_out(self, out: torch.Tensor) -> torch.Tensor:
        """``o_proj(out)`` through the registry's ``gemv`` (a decode-sized Triton GEMV that streams its weight
        while attention finishes: 4.2 against 6.0 us for cuBLAS at 2048x2048 on an H200), where one is
        installed and ``o_proj`` is a plain linear (a wrapped projection, e.g. an adapter, runs as a module)."""
        proj = self.o_proj
        if type(proj) is not nn.Linear:
            return proj(out)  # type: ignore[no-any-return]
        try:
            fn = kernel("gemv", out, proj.weight, rows=out.shape[0] * out.shape[1], hidden=proj.in_features)
        except KernelNotFoundError:  # an older plyx-kernel
            return proj(out)  # type: ignore[no-any-return]
        return fn(out, proj.weight, bias=proj.bias)  # type: ignore[no-any-return]

    def _attend_paged(self, q: torch.Tensor, step: KVStep) -> torch.Tensor:
        """Paged attention of ``q`` over what ``step`` cached (the new tokens included)."""
        k_pool, v_pool = step.pools(self.layer_idx)  # (num_blocks, block_size, KV, Dh) each
        tables, lens = step.paged  # type: ignore[misc]
        return self._paged_kernel(q, k_pool, v_pool, tables, lens, step)

    def _paged_kernel(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                      lens: torch.Tensor, step: KVStep) -> torch.Tensor:
        """``paged_attention`` of ``q [B, Tq, H, Dh]`` over this layer's pools, or ``paged_attention_quant`` over a
        quantised cache's int8 / fp8 pools and their scales (q keeps its dtype: the 8-bit tiles are widened in
        registers). The kernel is looked up once per step and shape (``KVStep.kernel_for``), not per layer."""
        scales = step.scales(self.layer_idx)
        if scales is not None:  # int8 / fp8 pools, (num_blocks, block_size, KV) float32 scales
            fp8 = int(k_pool.dtype == torch.float8_e4m3fn)
            fn = step.kernel_for("paged_attention_quant", (q.shape, q.dtype, k_pool.dtype), q, k_pool, v_pool,
                                 head_dim=self.head_dim, fp8=fp8)
            return fn(q, k_pool, v_pool, *scales, tables, lens, scale=self.scale,  # type: ignore[no-any-return]
                      window=self.sliding_window)
        q = q.to(k_pool.dtype)
        fn = step.kernel_for("paged_attention", (q.shape, q.dtype, k_pool.dtype), q, k_pool, v_pool,
                             head_dim=self.head_dim)
        return fn(q, k_pool, v_pool, tables, lens, scale=self.scale, window=self.sliding_window)  # type: ignore[no-any-return]

    def _attend_varlen(self, q: torch.Tensor, step: KVStep) -> torch.Tensor:
        """Paged attention of a packed step's queries ``[1, N, H, Dh]``, one launch per group of rows that feed
        the same number of tokens (``plyx.attn.begin_packed_step``); ``[1, N, H, Dh]``. A quantised cache's
        pools are read by ``paged_attention_quant`` (never dequantised whole)."""
        k_pool, v_pool = step.pools(self.layer_idx)  # (num_blocks, block_size, KV, Dh) each
        H, Dh = self.n_heads, self.head_dim
        flat = q.reshape(-1, H, Dh)  # (N, H, Dh)
        outs = []
        for g in step.varlen:  # type: ignore[union-attr]
            qg = flat[g.start:g.start + g.rows * g.query_len].view(g.rows, g.query_len, H, Dh)
            if g.tree_mask is not None:  # a token tree: prefix + ancestors, not bottom-right causal
                from plyx.attn._varlen import tree_attention

                outs.append(tree_attention(qg, k_pool, v_pool, g, scale=self.scale).reshape(-1, H, Dh))
                continue
            o = self._paged_kernel(qg, k_pool, v_pool, g.block_tables, g.context_lens, step)
            outs.append(o.reshape(-1, H, Dh))  # (rows * query_len, H, Dh)
        return (outs[0] if len(outs) == 1 else torch.cat(outs))[None]  # (1, N, H, Dh)

    def _attend_cached(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: KVStep) -> torch.Tensor:
        step.store(self.layer_idx, k, v)
        if step.varlen is not None:
            return self._attend_varlen(q, step)
        if step.paged is not None:
            return self._attend_paged(q, step)
        keys, values = step.gather(self.layer_idx)  # (B, S, KV, Dh), left-padded
        q = q.to(keys.dtype)
        mask = step.key_mask
        if mask is not None:
            mask = mask.expand(q.shape[0], 1, q.shape[1], keys.shape[1])  # (B, 1, T, S) view
        fn = kernel("attention", q, keys, values, head_dim=self.head_dim)
        return fn(q, keys, values, causal=True, scale=self.scale, mask=mask, window=self.sliding_window)

    def extra_repr(self) -> str:
        return (
            f"heads={self.n_heads}, kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, "
            f"qk_norm={self.q_norm is not None}, window={self.sliding_window}"
        )


def _pairs_of_qk(head_dim: int, index: int, rows: torch.Tensor) -> torch.Tensor:
    """``stacked_for_training``'s ``arrange`` for (q, k, v): q's and k's rows (weight ``[heads * Dh, D]`` or bias
    ``[heads * Dh]``) with each head's rotate-half halves interleaved into pairs; v's as they are."""
    if index == 2:
        return rows
    # (heads * Dh, ...) -> (heads, 2, Dh/2, ...) -> (heads, Dh/2, 2, ...) -> (heads * Dh, ...): one copy
    return rows.unflatten(0, (-1, 2, head_dim // 2)).transpose(1, 2).flatten(0, 2)
