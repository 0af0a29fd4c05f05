"""Draft heads on a frozen base for speculative decoding: Medusa heads and an EAGLE one-layer draft.

Both read the base's final-norm hidden states ``f_t`` (``TransformerLM(..., return_hidden=True)``, what the
LM head sees) and are trained while the base stays frozen (``plyx train`` with a ``[draft]`` table):

- Medusa (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding
  Heads", §2.1.1): head k (k = 1..K) is ``k`` residual blocks ``x + SiLU(W x + b)`` and its own LM head;
  from ``f_t`` it predicts token ``x_{t+k+1}`` (the base itself predicts ``x_{t+1}``). The residual
  blocks start at zero and each LM head as a copy of the base's, so an untrained head k predicts what
  the base predicts for the next token.
- EAGLE (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty", §4):
  ``f̂_{t+1} = Layer(FC([e_{t+1}; f_t]))``: the embedding of token ``x_{t+1}`` (the base's, frozen)
  concatenated with the feature ``f_t``, projected ``2D -> D`` and passed through one decoder layer of
  the base's shape (its own KV cache when drafting); the draft token distribution is the frozen LM
  head applied to the predicted feature. Drafting runs it autoregressively on its own predictions.

Heads are saved as a directory: ``draft_heads.safetensors`` (only the heads' weights; the base's are
never copied) and ``draft_heads.json`` (kind, sizes and the base's shape, checked on load).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from plyx.model._errors import CheckpointError
from plyx.model._model import DecoderLayer, _within_row, torch_dtype
from plyx.model._safetensors_io import atomic_directory
from plyx.specs.config.model import ModelConfig
from plyx.specs.kvcache import KVCache
from torch import nn

__all__ = [
    "DRAFT_KINDS",
    "DraftHeadsError",
    "EagleDraft",
    "MedusaHeads",
    "build_draft_heads",
    "check_base",
    "load_draft_heads",
    "save_draft_heads",
]

#: the kinds of draft heads (``DraftConfig.kind``)
DRAFT_KINDS = ("medusa", "eagle")
FORMAT = "plyx-draft-heads"
VERSION = 1
WEIGHTS = "draft_heads.safetensors"
CONFIG = "draft_heads.json"
#: base fields the heads' shapes depend on; a base that differs in one of them cannot use the heads
_BASE_FIELDS = ("vocab_size", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff", "arch", "rope_theta")


class DraftHeadsError(CheckpointError):
    """Draft heads that cannot be loaded, or that do not fit the base they are paired with."""


class ResBlock(nn.Module):
    """``x + SiLU(W x + b)``, W and b zero at init (Medusa's ResBlock: the block starts as the identity)."""

    def __init__(self, d_model: int, *, device: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.linear = nn.Linear(d_model, d_model, device=device, dtype=dtype)
        if torch.device(device or "cpu").type != "meta":
            nn.init.zeros_(self.linear.weight)
            nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """K Medusa heads over a base of ``base_config``: head k predicts the token k + 1 steps ahead.

    Args:
        base_config: the frozen base's ``ModelConfig`` (its ``d_model`` and ``vocab_size`` size the heads).
        num_heads: K, the most draft tokens one base forward proposes.
        num_layers: residual blocks per head (Medusa: 1).
    """

    kind = "medusa"

    def __init__(self, base_config: ModelConfig, *, num_heads: int = 4, num_layers: int = 1, device: Any = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.base_config = base_config
        self.num_heads = num_heads
        self.num_layers = num_layers
        D, V = base_config.d_model, base_config.vocab_size
        self.heads = nn.ModuleList(
            nn.Sequential(*(ResBlock(D, device=device, dtype=dtype) for _ in range(num_layers)),
                          nn.Linear(D, V, bias=False, device=device, dtype=dtype))
            for _ in range(num_heads)
        )

    @torch.no_grad()
    def init_from_base(self, base: nn.Module) -> MedusaHeads:
        """Each head's LM head a copy of the base's (Medusa's initialisation); returns self."""
        weight = base.lm_head_weight  # (V, D)
        for head in self.heads:
            head[-1].weight.copy_(weight)
        return self

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of every head, float32.

        Args:
            hidden: the base's final-norm hidden states ``[..., D]``.

        Returns:
            ``[K, ..., V]``: ``out[k - 1]`` at position t scores token ``x_{t+k+1}``.
        """
        return torch.stack([head(hidden) for head in self.heads]).float()

    def metadata(self) -> dict[str, Any]:
        return {"num_heads": self.num_heads, "num_layers": self.num_layers}


class EagleDraft(nn.Module):
    """EAGLE's draft: ``f̂_{t+1} = DecoderLayer(FC([embed(x_{t+1}); f_t]))`` with the base's layer shape.

    Args:
        base_config: the frozen base's ``ModelConfig``; the draft layer has its attention and MLP shape.
        num_heads: draft tokens proposed per round by default (``num_speculative_tokens``); not a weight shape.

    ``config`` is the base's with one layer: what a KV cache for the draft layer is built from
    (``plyx.attn.make_cache(kind, draft.config, ...)``).
    """

    kind = "eagle"

    def __init__(self, base_config: ModelConfig, *, num_heads: int = 4, device: Any = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.base_config = base_config
        self.num_heads = num_heads
        # one dense layer (an MoE base's draft layer is a plain SwiGLU of its d_ff)
        self.config = base_config.replace(n_layers=1, moe=None)
        D = base_config.d_model
        self.fc = nn.Linear(2 * D, D, bias=True, device=device, dtype=dtype)  # EAGLE's fc has a bias
        self.layer = DecoderLayer(self.config, 0, device=device, dtype=dtype)
        rotary = int(base_config.dim_per_head * base_config.partial_rotary) // 2 * 2
        self.rotary_dim = max(rotary, 2)  # as TransformerLM: the draft layer's RoPE is the base's

    @torch.no_grad()
    def init_from_base(self, base: nn.Module) -> EagleDraft:
        """The decoder layer starts as a copy of the base's last one and FC as ``[0 | I]`` (the feature
        passes through; the embedding half starts at zero): a draft that begins near the base's own
        last-layer computation trains faster than one from noise. Returns self."""
        if base.config.moe is None:  # an MoE layer's experts do not fit the dense draft layer
            self.layer.load_state_dict(base.layers[-1].state_dict())
        D = self.base_config.d_model
        self.fc.weight.zero_()
        self.fc.weight[:, D:].copy_(torch.eye(D))
        self.fc.bias.zero_()
        return self

    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        embed_weight: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        seq_ids: Any = None,
    ) -> torch.Tensor:
        """Predicted features ``[B, T, D]``: row b, position i gets ``[embed(input_ids[b, i]); features[b, i]]``.

        Args:
            input_ids: ``[B, T]`` tokens ``x_{t+1}`` (the token after each feature's position).
            features: ``[B, T, D]`` features ``f_t`` (the base's, or the draft's own when drafting ahead).
            embed_weight: the base's input embedding ``[V, D]`` (frozen, not part of the draft).
            attention_mask: ``[B, T]`` 1 for real entries, 0 for left padding.
            document_ids: ``[B, T]`` packed documents (training, no cache).
            position_ids: default: 0.. per row, or continuing from each sequence's cached length.
            cache, seq_ids: the draft layer's own KV cache (built from ``self.config``) and row ids.

        Returns:
            ``[B, T, D]`` predicted ``f̂_{t+1}``; the draft logits are ``f̂ @ lm_head_weight.T``.
        """
        from plyx.attn import begin_step
        from plyx.kernel import rope_tables

        B, T = input_ids.shape
        device = self.fc.weight.device
        attn: dict[str, Any] = {}
        real = None if attention_mask is None else attention_mask.to(device=device, dtype=torch.bool)
        within = _within_row(real) if real is not None else torch.arange(T, device=device)[None, :].expand(B, T)
        if cache is not None:
            step = begin_step(cache, seq_ids, B, T, real, device)
            attn["step"] = step
            if position_ids is None:
                position_ids = step.lengths_before[:, None] + within  # (B, T)
        else:
            if real is not None:
                attn["key_mask"] = real[:, None, None, :]  # (B, 1, 1, T)
            if document_ids is not None:
                attn["document_ids"] = document_ids.to(device)
            if position_ids is None:
                position_ids = within
        emb = F.embedding(input_ids.to(device), embed_weight)  # (B, T, D)
        x = self.fc(torch.cat([emb.to(self.fc.weight.dtype), features.to(self.fc.weight.dtype)], dim=-1))  # (B, T, D)
        c = self.base_config
        cos, sin = rope_tables(position_ids.to(device), self.rotary_dim, c.rope_theta, c.rope_scaling, dtype=x.dtype)
        return self.layer(x, cos, sin, **attn)  # (B, T, D)

    def metadata(self) -> dict[str, Any]:
        return {"num_heads": self.num_heads}


DraftHeads = MedusaHeads | EagleDraft


def build_draft_heads(kind: str, base_config: ModelConfig, *, num_heads: int = 4, num_layers: int = 1,
                      device: Any = None, dtype: Any = None) -> DraftHeads:
    """A fresh ``MedusaHeads`` or ``EagleDraft`` for a base of ``base_config``.

    Args:
        kind: ``"medusa"`` or ``"eagle"``.
        base_config: the base model's configuration.
        num_heads: Medusa heads (K), or EAGLE's default draft length.
        num_layers: residual blocks per Medusa head.
        device, dtype: where and how the parameters are made (default: the base's dtype).

    Returns:
        The module (random init; call ``init_from_base(base)`` for the papers' initialisation).
    """
    dt = torch_dtype(dtype if dtype is not None else base_config.dtype)
    if kind == "medusa":
        return MedusaHeads(base_config, num_heads=num_heads, num_layers=num_layers, device=device, dtype=dt)
    if kind == "eagle":
        return EagleDraft(base_config, num_heads=num_heads, device=device, dtype=dt)
    raise DraftHeadsError(f"draft heads kind {kind!r} not found; use one of {', '.join(DRAFT_KINDS)}")


def _base_shape(config: ModelConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in _BASE_FIELDS if hasattr(config, name)}


def check_base(heads_base: dict[str, Any], base_config: ModelConfig, *, source: str = "the draft heads") -> None:
    """Raise ``DraftHeadsError`` naming every field where the heads' base differs from ``base_config``."""
    ours = _base_shape(base_config)
    diffs = [f"{k}: {heads_base.get(k)!r} for the heads vs {v!r} for the base" for k, v in ours.items()
             if k in heads_base and heads_base[k] != v]
    if diffs:
        raise DraftHeadsError(
            f"{source} were trained for another base model ({'; '.join(diffs)}); pair them with the base they "
            f"were trained on, or train heads for this base with `plyx train` and a [draft] table"
        )


def save_draft_heads(heads: DraftHeads, path: str | os.PathLike[str], *, base: str = "",
                     extra: dict[str, Any] | None = None) -> Path:
    """Write ``heads`` to directory ``path`` (atomic: a reader sees the old directory or the new one).

    Args:
        heads: the trained ``MedusaHeads`` / ``EagleDraft``.
        path: the directory (replaced when it exists).
        base: the base checkpoint they were trained on (recorded for ``plyx`` commands; optional).
        extra: more JSON fields to record (training step, per-head accuracy...).

    Returns:
        The directory.
    """
    from safetensors.torch import save_file

    out = Path(path)
    doc = {
        "format": FORMAT, "version": VERSION, "kind": heads.kind, **heads.metadata(),
        "dtype": str(next(heads.parameters()).dtype).removeprefix("torch."),
        "base": _base_shape(heads.base_config), "base_config": heads.base_config.to_dict(),
        "base_checkpoint": str(base), **(extra or {}),
    }
    state = {k: v.detach().contiguous().cpu() for k, v in heads.state_dict().items()}
    with atomic_directory(out) as tmp:
        save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / CONFIG).write_text(json.dumps(doc, indent=2) + "\n")
    return out


def load_draft_heads(path: str | os.PathLike[str], base: nn.Module | ModelConfig | None = None, *,
                     device: Any = "cpu", dtype: Any = None) -> DraftHeads:
    """Load draft heads saved by ``save_draft_heads`` (safetensors: no pickle).

    Args:
        path: the heads' directory.
        base: the base model (or its config) they will run on: its shape is checked against the heads'.
        device: where the parameters go.
        dtype: parameter dtype (default: the base model's when given, else the stored one).

    Returns:
        ``MedusaHeads`` or ``EagleDraft`` in eval mode.

    Raises:
        DraftHeadsError: ``path`` is not a draft-heads directory, its files are incomplete, or the base
            differs (the message names each differing field: vocab_size, d_model...).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = Path(path)
    doc_path, weights = p / CONFIG, p / WEIGHTS
    if not p.is_dir() or not doc_path.is_file() or not weights.is_file():
        what = "does not exist" if not p.exists() else "is not a directory" if not p.is_dir() else \
            f"has no {CONFIG if not doc_path.is_file() else WEIGHTS}"
        raise DraftHeadsError(
            f"{p} is not a draft-heads checkpoint: it {what}; pass the directory `plyx train` wrote with a [draft] "
            f"table (it holds {CONFIG} and {WEIGHTS})"
        )
    try:
        doc = json.loads(doc_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DraftHeadsError(f"{doc_path} is not valid JSON ({exc}); re-save the heads") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise DraftHeadsError(f"{doc_path} is not a draft-heads config (format {doc.get('format') if isinstance(doc, dict) else None!r}, "
                              f"expected {FORMAT!r}); pass a directory written by save_draft_heads")
    if int(doc.get("version", 0)) > VERSION:
        raise DraftHeadsError(f"{doc_path} has version {doc['version']}, newer than this plyx-model reads "
                              f"({VERSION}); upgrade plyx-model")
    base_config = ModelConfig.from_dict(doc["base_config"])
    if base is not None:
        config = base if isinstance(base, ModelConfig) else base.config
        check_base(doc["base"], config, source=f"the draft heads in {p}")
        if dtype is None and not isinstance(base, ModelConfig):
            dtype = next(base.parameters()).dtype
    heads = build_draft_heads(doc["kind"], base_config, num_heads=int(doc.get("num_heads", 4)),
                              num_layers=int(doc.get("num_layers", 1)), device="meta",
                              dtype=dtype if dtype is not None else doc.get("dtype"))
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError) as exc:
        raise DraftHeadsError(f"{weights} cannot be read as safetensors ({exc}); the file is truncated or not "
                              f"a weights file: re-save the heads") from None
    target = next(heads.parameters()).dtype
    try:
        heads.load_state_dict({k: v.to(device=device, dtype=target) for k, v in state.items()}, strict=True,
                              assign=True)
    except RuntimeError as exc:
        raise DraftHeadsError(f"{weights} does not fit the {doc['kind']} heads its config describes: {exc}") from None
    return heads.eval()
