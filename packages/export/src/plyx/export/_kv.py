"""The decoding graph: one ONNX graph with past key/values in and present key/values out.

Named as Hugging Face Optimum and onnxruntime-genai name a decoder's inputs and
outputs, so their runtimes (and any hand-written loop) drive it unchanged::

    input_ids                   int64  [batch_size, sequence_length]
    attention_mask              int64  [batch_size, total_sequence_length]     1 = real token, 0 = left padding
    position_ids                int64  [batch_size, sequence_length]
    past_key_values.N.key/value float  [batch_size, num_key_value_heads, past_sequence_length, head_dim]
    -> logits                   float32 [batch_size, sequence_length, vocab_size]
    -> present.N.key/value      float  [batch_size, num_key_value_heads, total_sequence_length, head_dim]

``total_sequence_length = past_sequence_length + sequence_length``. The prefill
is the same graph with an empty past (``past_sequence_length = 0``), so one file
serves both phases (Optimum's "merged" decoder without the ``use_cache_branch``
switch: an empty past makes it unnecessary).

The layer math is the model's own modules (norms, projections, MLP, the RoPE
kernel's reference); only the attention over ``past + new`` keys is written
here, because the model's cached attention goes through a ``KVCache`` object
that a graph cannot carry. The onnxruntime checks (logit parity and a greedy
decode equal to plyx's) are what prove the two agree.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["KVDecoder", "kv_input_names", "kv_output_names"]


def kv_input_names(n_layers: int) -> list[str]:
    """``input_ids, attention_mask, position_ids, past_key_values.0.key, past_key_values.0.value, ...``."""
    names = ["input_ids", "attention_mask", "position_ids"]
    for i in range(n_layers):
        names += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
    return names


def kv_output_names(n_layers: int) -> list[str]:
    """``logits, present.0.key, present.0.value, ...``."""
    names = ["logits"]
    for i in range(n_layers):
        names += [f"present.{i}.key", f"present.{i}.value"]
    return names


class KVDecoder(nn.Module):
    """A ``TransformerLM`` step over ``past + new`` tokens with explicit key/value tensors.

    Args:
        model: the ``TransformerLM`` (its modules are used as they are, not copied).

    ``forward(input_ids, attention_mask, position_ids, *past)`` returns
    ``(logits, *present)`` with ``past``/``present`` ordered ``layer 0 key, layer 0 value, layer 1 key, ...``.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        c = model.config
        self.n_layers = c.n_layers
        self.n_heads, self.n_kv_heads, self.head_dim = c.n_heads, c.kv_heads, c.dim_per_head

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                *past: torch.Tensor) -> tuple[torch.Tensor, ...]:
        from plyx.kernel import registry, rope_tables

        model, c = self.model, self.model.config
        B, T = input_ids.shape
        P = past[0].shape[2]
        h = model.embed_tokens(input_ids)  # (B, T, D)
        cos, sin = rope_tables(position_ids, model.rotary_dim, c.rope_theta, c.rope_scaling, dtype=h.dtype)
        allowed = _allowed(attention_mask, P, T, c.sliding_window)  # (B, 1, T, P + T) bool
        presents: list[torch.Tensor] = []
        for i, layer in enumerate(model.layers):
            x = layer.input_layernorm(h)
            attn = layer.self_attn
            q = attn.q_proj(x).view(B, T, self.n_heads, self.head_dim)  # (B, T, H, Dh)
            k = attn.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)  # (B, T, KV, Dh)
            v = attn.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
            if attn.q_norm is not None and attn.k_norm is not None:
                q, k = attn.q_norm(q), attn.k_norm(k)
            rope = registry().get("rope", q, cos, sin, head_dim=self.head_dim)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            k = torch.cat((past[2 * i], k.transpose(1, 2)), dim=2)  # (B, KV, P + T, Dh)
            v = torch.cat((past[2 * i + 1], v.transpose(1, 2)), dim=2)
            presents += [k, v]
            out = _attention(q.transpose(1, 2), k, v, allowed, attn.scale)  # (B, H, T, Dh)
            a = attn.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))  # (B, T, D)
            x, h = layer.post_attention_layernorm(a.to(h.dtype), residual=h)
            h = h + layer.mlp(x)
        logits = model._epilogue(h, False)  # (B, T, V) float32
        return (logits, *presents)


def _allowed(attention_mask: torch.Tensor, past: Any, new: int, window: int | None) -> torch.Tensor:
    """Which key each query may read: ``[B, 1, T, P + T]`` bool.

    Query ``t`` sits at key index ``P + t``: it reads keys at or before it (causal),
    within ``window`` of it (sliding window), and only where ``attention_mask`` is 1.
    """
    total = attention_mask.shape[1]
    key_idx = torch.arange(total, device=attention_mask.device)  # (S,)
    query_idx = torch.arange(new, device=attention_mask.device) + past  # (T,)
    allowed = key_idx[None, :] <= query_idx[:, None]  # (T, S)
    if window is not None:
        allowed = allowed & (key_idx[None, :] > query_idx[:, None] - window)
    return allowed[None, None] & attention_mask.bool()[:, None, None, :]  # (B, 1, T, S)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention with grouped key/value heads: q ``[B, H, T, Dh]``, k/v ``[B, KV, S, Dh]`` -> ``[B, H, T, Dh]``.

    Scores are float32 whatever the weights (as the reference kernel computes them);
    a masked score is the dtype's most negative value, not -inf, so a fully padded
    query row gives uniform weights instead of NaN (its output is never used).
    """
    B, H, T, Dh = q.shape
    KV = k.shape[1]
    group = H // KV
    qg = q.reshape(B, KV, group * T, Dh).float()  # (B, KV, G*T, Dh): each KV head's G query heads stacked
    scores = torch.matmul(qg, k.float().transpose(-1, -2)) * scale  # (B, KV, G*T, S)
    scores = scores.view(B, KV, group, T, -1)
    scores = scores.masked_fill(~allowed[:, :, None], torch.finfo(torch.float32).min)  # mask (B, 1, 1, T, S)
    weights = F.softmax(scores, dim=-1).view(B, KV, group * T, -1)
    out = torch.matmul(weights, v.float())  # (B, KV, G*T, Dh)
    return out.view(B, H, T, Dh).to(q.dtype)
