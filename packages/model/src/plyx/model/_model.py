"""``TransformerLM``: a Llama / Qwen2 / Qwen3 / Mistral decoder built from ``ModelConfig``.

One residual stream of width D through ``n_layers`` pre-norm blocks::

    h = embed(ids)                                   # (B, T, D)
    for block in layers:
        h = h + attn(rmsnorm(h))                     # RoPE, GQA, QK-norm (qwen3), window (mistral)
        h = h + down(swiglu(gate(rmsnorm(h)), up(rmsnorm(h))))   # or a mixture of experts (ModelConfig.moe,
                                                     # plyx.model._moe.SparseMoE)
    logits = rmsnorm(h) @ lm_head.T                  # (B, T, V), float32

Every op with a kernel (``rmsnorm``, ``swiglu``, ``rope``, ``attention``,
``paged_attention``) is resolved by name from the kernel registry. Model code
is single-device; parallelism is applied from outside (plyx-dist).
Parameter names follow Hugging Face's without the ``model.`` prefix, so the
two layouts map one to one (``plyx.model._hf``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from plyx.attn import (
    Attention,
    KVStep,
    RMSNorm,
    begin_step,
    pack_linears_,
    packed_for_inference,
    weight_reads_exact,
)
from plyx.specs.config.model import ModelConfig
from plyx.specs.kvcache import KVCache
from torch import nn

__all__ = ["DecoderLayer", "MLP", "TransformerLM", "torch_dtype"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(_DTYPES)}") from None


def _kernel(name: str, *tensors: Any, **shape: int) -> Any:
    if torch.compiler.is_compiling():  # an opaque custom op for Inductor (plyx-kernel >= 1.3), not the kernel's code
        # the module itself, not `plyx.kernel.traceable`: the package's names load lazily (PEP 562), which
        # Dynamo need not resolve through the module's __getattr__
        from plyx.kernel._custom_ops import traceable

        op = traceable(name)
        if op is not None:
            return op
    from plyx.kernel import registry

    return registry().get(name, *tensors, **shape)


def _optional_kernel(name: str, *tensors: Any, **shape: int) -> Any:
    """``_kernel``, or None when no implementation of ``name`` is installed (an older plyx-kernel)."""
    from plyx.specs.kernels import KernelNotFoundError

    try:
        return _kernel(name, *tensors, **shape)
    except KernelNotFoundError:
        return None


#: static steps of at most this many rows (batch x new tokens) run the input RMSNorm inside the q/k/v
#: projection (``rmsnorm_linear``): the Triton kernel's row limit; beyond it the separate norm + cuBLAS are faster
FUSED_ROWS = 2


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))`` with ``gate``/``up`` ``[F, D]`` and ``down`` ``[D, F]``."""

    def __init__(self, d_model: int, d_ff: int, *, device: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d_model, d_ff, bias=False, device=device, dtype=dtype)
        self.up_proj = nn.Linear(d_model, d_ff, bias=False, device=device, dtype=dtype)
        self.down_proj = nn.Linear(d_ff, d_model, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, *, packed: bool = False) -> torch.Tensor:
        """``packed``: use the stacked gate/up weight when there is one (static decode steps, no gradient)."""
        stacked = packed_for_inference((self.gate_proj, self.up_proj)) if packed else None
        if stacked is not None:
            gate, up = F.linear(x, *stacked).chunk(2, dim=-1)  # one GEMV; the swiglu kernel takes the row stride
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)  # (B, T, F) each
        return self.down_proj(_kernel("swiglu", gate, up, hidden=gate.shape[-1])(gate, up))

    def pack_projections_(self) -> None:
        """Stack the gate and up weights in one buffer (same parameters and values)."""
        pack_linears_((self.gate_proj, self.up_proj))


class DecoderLayer(nn.Module):
    """One pre-norm block: attention then SwiGLU, each behind an RMSNorm, both residual."""

    def __init__(self, config: ModelConfig, layer_idx: int, *, device: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        c = config
        self.input_layernorm = RMSNorm(c.d_model, c.norm_eps, device=device, dtype=dtype)
        attention = Attention
        if c.qk_norm and c.qk_norm_scope == "projection":
            from plyx.model._qk_norm import ProjectionQKNormAttention as attention  # OLMoE
        self.self_attn = attention(
            d_model=c.d_model,
            n_heads=c.n_heads,
            n_kv_heads=c.kv_heads,
            head_dim=c.dim_per_head,
            qkv_bias=c.qkv_bias,
            qk_norm=c.qk_norm,
            norm_eps=c.norm_eps,
            sliding_window=c.sliding_window,
            layer_idx=layer_idx,
            device=device,
            dtype=dtype,
        )
        self.post_attention_layernorm = RMSNorm(c.d_model, c.norm_eps, device=device, dtype=dtype)
        self.mlp: nn.Module
        if c.moe is not None:
            from plyx.model._moe import SparseMoE

            self.mlp = SparseMoE(c, device=device, dtype=dtype)
        else:
            self.mlp = MLP(c.d_model, c.d_ff, device=device, dtype=dtype)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, **attn: Any) -> torch.Tensor:
        a = self.self_attn(self.input_layernorm(h), cos, sin, **attn)  # (B, T, D)
        # one kernel call: x = rmsnorm(a + h), and the new residual stream h = a + h.
        # Under autocast the projections return bf16 while the residual stream stays in
        # the parameters' dtype; the stream keeps its precision, as transformers' does.
        x, h = self.post_attention_layernorm(a.to(h.dtype), residual=h)
        step = attn.get("step")
        return h + self.mlp(x, packed=step is not None and step.slots is not None)

    def static_step(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                    step: KVStep) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` of a static decode step with the residual add deferred (vLLM's layout).

        Returns ``(mlp_out, residual)`` where ``forward`` would return their sum: the next layer's
        input RMSNorm (or the final norm) adds them in its own kernel, so no layer launches a
        separate residual add. ``residual`` is None for the first layer (``h`` is the stream).
        Same values as ``forward``: the fused add rounds ``x + residual`` to the stream's dtype,
        as the plain add does.
        """
        if residual is not None:
            h = h.to(residual.dtype)
        fused = self._fused_step(h, residual, cos, sin, step)
        if fused is not None:
            return fused
        if residual is None:
            x, residual = self.input_layernorm(h), h
        else:
            x, residual = self.input_layernorm(h, residual=residual)
        a = self.self_attn(x, cos, sin, step=step)  # (B, T, D)
        x, residual = self.post_attention_layernorm(a.to(residual.dtype), residual=residual)
        return self.mlp(x, packed=True), residual

    def _fused_step(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                    step: KVStep) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``static_step`` with the input RMSNorm inside the packed q/k/v projection (``rmsnorm_linear``) and the
        SwiGLU inside the down projection (``swiglu_linear``).

        Chosen by measurement on an H200 at one row: the norm + q/k/v kernel beat RMSNorm + cuBLAS (6.9 vs
        8.3 us) but a norm + gate/up kernel did not (cuBLAS streams wide weights faster), and SwiGLU + down
        in one pipelined GEMV beat swiglu + cuBLAS's split-K GEMV and reduce (9.0 vs 12.0 us); see
        plyx-kernel's bench results. None where it does not apply (more rows than ``FUSED_ROWS``, unpacked
        weights, QK-norm, an older plyx-kernel): the caller takes the plain path.
        """
        B, T, D = h.shape
        attn = self.self_attn
        if B * T > FUSED_ROWS or attn.q_norm is not None:
            return None
        qkv_w = packed_for_inference((attn.q_proj, attn.k_proj, attn.v_proj))
        norm = _optional_kernel("rmsnorm_linear", h, self.input_layernorm.weight, rows=B * T, hidden=D)
        if qkv_w is None or norm is None:
            return None
        ln = self.input_layernorm
        qkv, residual = norm(h, ln.weight, qkv_w[0], eps=ln.eps, residual=residual, bias=qkv_w[1])
        a = attn.attend_projected(qkv.view(B, T, attn.n_heads + 2 * attn.n_kv_heads, attn.head_dim), cos, sin, step)
        if a is None:
            return None  # nothing was written yet: rope_store_kv is the first cache write
        x, residual = self.post_attention_layernorm(a.to(residual.dtype), residual=residual)
        mlp = self.mlp
        if not isinstance(mlp, MLP):  # a mixture of experts: its own grouped kernels
            return mlp(x, packed=True), residual
        gate_up = packed_for_inference((mlp.gate_proj, mlp.up_proj))
        down = _optional_kernel("swiglu_linear", x, mlp.down_proj.weight, rows=B * T, hidden=mlp.down_proj.in_features)
        if gate_up is None or down is None or not weight_reads_exact(mlp.down_proj):  # e.g. an unmerged adapter
            return mlp(x, packed=True), residual
        # the SwiGLU inside the down projection's GEMV (one launch for cuBLAS's split-K GEMV, its reduce and swiglu)
        return down(F.linear(x, *gate_up), mlp.down_proj.weight, bias=mlp.down_proj.bias), residual


class TransformerLM(nn.Module):
    """A decoder-only language model of ``config``.

    Args:
        config: the architecture (``plyx.specs.ModelConfig``).
        device: where to build the parameters (``"meta"`` builds no storage).

    Example::

        model = TransformerLM(ModelConfig(arch="qwen3", d_model=256, n_layers=4, n_heads=4, qk_norm=True))
        logits = model(torch.randint(0, 32000, (2, 16)))          # (2, 16, 32000) float32
    """

    def __init__(self, config: ModelConfig, *, device: Any = None) -> None:
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise TypeError(
                f"TransformerLM needs a plyx.specs.ModelConfig (got {type(config).__name__}); "
                f"build one with ModelConfig(...) or ModelConfig.from_dict(d)"
            )
        self.config = config
        dtype = torch_dtype(config.dtype)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model, device=device, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, i, device=device, dtype=dtype) for i in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps, device=device, dtype=dtype)
        if config.tie_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False, device=device, dtype=dtype)
        rotary = int(config.dim_per_head * config.partial_rotary) // 2 * 2
        self.rotary_dim = max(rotary, 2)
        # static decode steps' cos/sin rows by (device, dtype): derived data, not state (no buffer, no checkpoint)
        self._rope_tables: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._arange_rope: dict[tuple[torch.device, torch.dtype, int], tuple[torch.Tensor, torch.Tensor]] = {}
        if torch.device(device or "cpu").type != "meta":
            self.reset_parameters()

    # -- parameters ------------------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, init_std) weights; residual output projections scaled by 1/sqrt(2 * n_layers) (GPT-2)."""
        std = self.config.init_std
        out_std = std / math.sqrt(2 * self.config.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            elif name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                p.normal_(0.0, out_std)
            else:
                p.normal_(0.0, std)

    @torch.no_grad()
    def pack_projections_(self) -> TransformerLM:
        """Stack each layer's q/k/v weights and its gate/up weights in one buffer each, in place.

        Parameters keep their names and values (each becomes a row slice of the buffer; no copy is
        kept), so ``state_dict``, checkpoints and optimizers are unchanged. Static decode steps
        (``kv_step``) then run one GEMV for q/k/v and one for gate/up. Moving or replacing the
        weights undoes it (the layers fall back to one GEMV per projection). Returns the model.
        """
        for layer in self.layers:
            layer.self_attn.pack_projections_()
            layer.mlp.pack_projections_()
        return self

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The ``[V, D]`` output projection (the input embedding when tied)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def num_params(self, *, non_embedding: bool = False) -> int:
        """Parameters, each shared tensor counted once; ``non_embedding`` leaves out the input embedding."""
        total = sum(p.numel() for p in self.parameters())
        if non_embedding:
            total -= self.embed_tokens.weight.numel() if self.lm_head is not None else 0
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward) at context ``seq_len``, for MFU.

        ``6 N + 12 L H Dh T`` (PaLM, appendix B): 6 FLOPs per weight per token for
        the matmuls (N excludes the input embedding lookup, includes the LM head),
        plus the attention scores and values, not halved for causality.
        """
        c = self.config
        from plyx.model._moe import inactive_expert_params  # a token runs through k of the E experts

        active = self.num_params(non_embedding=True) - inactive_expert_params(c)
        return 6.0 * active + 12.0 * c.n_layers * c.n_heads * c.dim_per_head * seq_len

    def router_aux_loss(self) -> torch.Tensor | None:
        """The MoE router losses of the last training forward, weighted by ``config.moe`` (None: dense or none
        recorded); the trainer adds it to the loss. See ``plyx.model._moe.router_aux_loss``."""
        from plyx.model._moe import router_aux_loss

        return router_aux_loss(self)

    def router_metrics(self) -> dict[str, float]:
        """Router statistics (``moe/...``: losses, tokens per expert, imbalance, drops) for training metrics."""
        from plyx.model._moe import router_metrics

        return router_metrics(self)

    # -- forward ---------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        seq_ids: Sequence[int] | None = None,
        kv_step: KVStep | None = None,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """Logits ``[B, T, V]`` (float32), or the final-norm hidden states ``[B, T, D]``.

        Args:
            input_ids: ``[B, T]`` token ids.
            position_ids: ``[B, T]`` or ``[T]``; default: 0.. per row, restarting at each
                document of ``document_ids``, skipping left padding, and continuing
                from each sequence's cached length when a cache is given.
            document_ids: ``[B, T]`` packed documents (training); tokens attend only within theirs.
            attention_mask: ``[B, T]`` with 1 for real tokens, 0 for left padding.
            cache: any ``plyx.specs.KVCache``; the step reserves room for each row's real
                tokens (``cache.reserve(seq_ids, counts)``), appends every layer's keys and
                values, and attends over everything cached. Unknown ``seq_ids`` are allocated.
            seq_ids: cache sequence id of each row (default ``0..B-1``).
            kv_step: a prepared cache step instead of ``cache`` (``plyx.attn.StaticDecode.inputs``):
                the forward then does no host work, so it can be captured in a CUDA graph;
                ``position_ids`` are required.
            return_hidden: return the final-norm hidden states instead of logits
                (the trainer feeds them to ``linear_cross_entropy`` with ``lm_head_weight``).
        """
        if kv_step is not None:
            h, cos, sin, _ = self._static_prologue(input_ids, position_ids, kv_step)
            residual = None
            for layer in self.layers:
                h, residual = layer.static_step(h, residual, cos, sin, kv_step)
            h = self.norm(h.to(residual.dtype), residual=residual)[0]  # the last residual add, fused
            return self._epilogue(h, return_hidden, normed=True)
        h, cos, sin, attn = self._prologue(input_ids, position_ids, document_ids, attention_mask, cache, seq_ids)
        for layer in self.layers:
            h = layer(h, cos, sin, **attn)
        return self._epilogue(h, return_hidden)

    def _prologue(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        document_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        cache: KVCache | None,
        seq_ids: Sequence[int] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]]:
        """Embeddings, RoPE tables and the attention arguments shared by every layer."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T] (got shape {list(input_ids.shape)}); add a batch dim with ids[None]")
        B, T = input_ids.shape
        device = self.embed_tokens.weight.device
        input_ids = input_ids.to(device)
        if document_ids is not None and cache is not None:
            raise ValueError("document_ids (packed training) and cache (inference) cannot be combined; pass one")
        attn: dict[str, Any] = {}
        real = None if attention_mask is None else attention_mask.to(device=device, dtype=torch.bool)
        if cache is not None:
            step = begin_step(cache, seq_ids, B, T, real, device)
            attn["step"] = step
            if position_ids is None:
                offsets = step.lengths_before[:, None]  # (B, 1)
                position_ids = offsets + (_within_row(real) if real is not None else
                                          torch.arange(T, device=device)[None, :])
        else:
            if real is not None:
                attn["key_mask"] = real[:, None, None, :]  # (B, 1, 1, T)
            if document_ids is not None:
                document_ids = document_ids.to(device)
                attn["document_ids"] = document_ids
            if position_ids is None:
                if document_ids is not None:
                    position_ids = _document_positions(document_ids)
                elif real is not None:
                    position_ids = _within_row(real)
                else:
                    h = self.embed_tokens(input_ids)  # (B, T, D)
                    cos, sin = self._arange_tables(T, h.device, h.dtype)
                    return h, cos, sin, attn
        position_ids = position_ids.to(device)
        h = self.embed_tokens(input_ids)  # (B, T, D)
        from plyx.kernel import rope_tables

        c = self.config
        cos, sin = rope_tables(position_ids, self.rotary_dim, c.rope_theta, c.rope_scaling, dtype=h.dtype)
        return h, cos, sin, attn

    def _arange_tables(self, length: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's ``(cos, sin)`` at positions ``0..length-1`` (every row of a training batch without packing or
        padding), ``[length, R/2]``: computed by ``rope_tables`` once per length, device and dtype and then the
        same tensors every step, so the kernels may keep what they derive from them (the reference's rotate-half
        layout); about ten dispatched ops per forward fewer at nanoGPT's CPU recipe (issue 20). Outside
        ``torch.compile``/export and inference mode, whose tensors could not serve a later training step."""
        from plyx.kernel import rope_tables

        c = self.config
        if torch.compiler.is_compiling() or torch.is_inference_mode_enabled():
            return rope_tables(torch.arange(length, device=device), self.rotary_dim, c.rope_theta, c.rope_scaling,
                               dtype=dtype)
        key = (device, dtype, length)
        tables = self._arange_rope.get(key)
        if tables is None:
            if len(self._arange_rope) >= 8:
                self._arange_rope.clear()  # a run sees one or two lengths; bound it anyway
            tables = self._arange_rope[key] = rope_tables(torch.arange(length, device=device), self.rotary_dim,
                                                          c.rope_theta, c.rope_scaling, dtype=dtype)
        return tables

    def _static_prologue(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None, step: KVStep
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]]:
        """``_prologue`` of a prepared step: device tensors in, no checks that read them on the host."""
        if position_ids is None:
            raise ValueError("kv_step needs position_ids (the step's, from StaticDecode.inputs)")
        h = self.embed_tokens(input_ids)  # (B, T, D)
        table = self._rope_table(h.device, h.dtype, int(step.cache.layout.max_seq_len))
        rows = table.index_select(0, position_ids.reshape(-1)).view(*position_ids.shape, *table.shape[1:])
        return h, rows[..., 0, :], rows[..., 1, :], {"step": step}

    def _rope_table(self, device: torch.device, dtype: torch.dtype, length: int) -> torch.Tensor:
        """``[length, 2, R/2]``: cos and sin of every position below ``length`` (a static step's positions are
        cache slots, so below the cache's ``max_seq_len``), computed once per device and dtype by ``rope_tables``.

        A static step then gathers its rows in one launch instead of computing the tables in about ten
        (frequencies, angles, cos, sin, casts); the values are the same, element by element.
        """
        from plyx.kernel import rope_tables

        key = (device, dtype)
        table = self._rope_tables.get(key)
        if table is None or table.shape[0] < length:
            c = self.config
            cos, sin = rope_tables(torch.arange(length, device=device), self.rotary_dim, c.rope_theta,
                                   c.rope_scaling, dtype=dtype)
            table = self._rope_tables[key] = torch.stack((cos, sin), dim=1)
        return table

    def _epilogue(self, h: torch.Tensor, return_hidden: bool, *, normed: bool = False) -> torch.Tensor:
        if not normed:
            h = self.norm(h)  # (B, T, D)
        if return_hidden:
            return h
        return torch.matmul(h, self.lm_head_weight.t()).float()  # (B, T, V)

    def extra_repr(self) -> str:
        c = self.config
        return f"arch={c.arch}, params={self.num_params():,}, tie_embeddings={c.tie_embeddings}"


def _within_row(real: torch.Tensor) -> torch.Tensor:
    """Position of each real token among its row's real tokens (padding gets 0): ``[B, T]``."""
    return (real.long().cumsum(dim=1) - 1).clamp(min=0)


def _document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """Positions restarting at 0 where ``document_ids`` changes along each row: ``[B, T]``."""
    B, T = document_ids.shape
    idx = torch.arange(T, device=document_ids.device).expand(B, T)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    # index of the most recent document start at or before each token
    last_start = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - last_start
