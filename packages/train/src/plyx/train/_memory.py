"""Pre-flight memory planning: what a training step of ``TransformerLM`` holds at its peak, term by term.

The peak of an eager step is at the start of the backward pass (all saved activations alive, the loss's
gradients computed) or at its end (all gradients alive, activations freed)::

    forward end = weights + optimizer states + [grads, grad_accum > 1] + [bf16 weight copies, autocast]
                  + L x (activations saved per layer) + loss + one layer's backward workspace
    backward end = weights + grads + optimizer states

Saved activations per token and layer, counted from what autograd keeps (the layer's input h, the
normed inputs of the projections, q/k/v after RoPE, the attention output and its log-sum-exp, the
residual stream after attention, gate, up and their SwiGLU), with ``D`` d_model, ``Dkv`` = KV x head_dim,
``F`` d_ff, ``H`` heads, ``r`` the stream's (parameters') bytes and ``a`` the activations' bytes::

    float32:        r (6 D + 2 Dkv + 3 F) + 4 H + 12
    bf16-autocast:  r 2 D + a (7 D + 2 Dkv + 3 F) + 4 H + 8     (each projection saves its own bf16 cast
                                                               of the normed input: 3 for q/k/v, 2 for gate/up)

Attention saves O(T) (flash / SDPA keep the output and log-sum-exp, not the T x T scores). With
activation checkpointing a layer keeps only its input (``r D`` per token) and one layer is recomputed at
a time. The loss (``linear_cross_entropy``) holds one ``[chunk, V]`` logits block, never ``[N, V]``.

The old estimate (a Korthikanti table sized for Megatron's unfused layers, ``34 D + 5 H T`` values per
token, T x T scores included) refused 8 x 2048 of a 1B model as 281.7 GiB; this one says 42.0 GiB there
and 20.4 GiB at 2 x 2048, which peaked at 24 GB on an H200.
"""

from __future__ import annotations

import math

import attrs
from plyx.specs import TrainConfig

__all__ = ["MemoryEstimate", "OPTIMIZER_STATE_BYTES", "plan_memory", "propose_fit"]

GiB = 2**30

#: optimizer state bytes per parameter of the built-in optimizers: AdamW two float32 moments; SGD one
#: momentum buffer; adamw8bit one byte per moment plus a float32 absmax per 2048 values; adafactor a float32
#: row and column statistic per matrix, 4 (R + C) / (R C) bytes per value (0.003 for a 2048 x 5632 MLP
#: matrix, 0.06 for 128 x 128), plus full float32 statistics of the vectors (norm gains): 0.15 bounds even the
#: tiny test models (0.12 measured at d_model 64 by bench/optimizer_memory.py); a negligible term at scale
OPTIMIZER_STATE_BYTES = {"adamw": 8, "sgd": 4, "adamw8bit": 2 + 8 / 2048, "adafactor": 0.15}

#: elements of one logits block of the fused loss (plyx-kernel's Triton ``linear_cross_entropy``: 2^26; the
#: reference: 2^22 float32 values, with ~3 blocks alive in its backward: logits, probabilities, dz)
_LOSS_BLOCK = {"cuda": (1 << 26, 1), "cpu": (1 << 22, 3)}


@attrs.frozen(kw_only=True)
class MemoryEstimate:
    """Bytes a training step holds at its peak, by term.

    Attributes:
        weights: parameters (their own dtype).
        grads: gradients (the parameters' dtype), counted at the peak when alive there.
        optimizer: optimizer states (AdamW: two float32 moments per parameter).
        weight_copies: autocast's bf16 copies of the weights, saved for the backward.
        activations: activations saved for the backward, all layers.
        per_layer: activations saved by one layer (without checkpointing).
        loss: the loss's logits block and its gradient buffers.
        workspace: one layer's backward temporaries (or recomputation, with checkpointing).
        total: the peak.
    """

    weights: int
    grads: int
    optimizer: int
    weight_copies: int
    activations: int
    per_layer: int
    loss: int
    workspace: int
    total: int

    def table(self) -> str:
        """The terms in one line (GiB, or MiB below 1 GiB)."""
        rows = [("weights", self.weights), ("gradients", self.grads), ("optimizer states", self.optimizer),
                ("bf16 weight copies", self.weight_copies), ("activations", self.activations),
                ("loss", self.loss), ("backward workspace", self.workspace)]
        return ", ".join(f"{name} {_size(v)}" for name, v in rows if v) + f"; peak {_size(self.total)}"


def _size(n: int) -> str:
    """Bytes as GiB, or MiB below 1 GiB."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


def plan_memory(config: TrainConfig, num_params: int, *, device_type: str = "cuda", batch_size: int | None = None,
                checkpointing: bool | None = None, optimizer_bytes_per_param: float | None = None) -> MemoryEstimate:
    """The peak memory of one training step of ``config`` (``TransformerLM``, eager), term by term.

    Args:
        config: the run (model shape, batch, sequence length, precision, grad_accum, checkpointing).
        num_params: trainable parameters (each tensor once).
        device_type: ``"cuda"`` (Triton/flash kernels) or ``"cpu"`` (reference kernels; their loss blocks).
        batch_size, checkpointing: overrides of the config's (to search for a plan that fits).
        optimizer_bytes_per_param: optimizer state bytes per parameter (default: by ``config.optimizer.name``,
            ``OPTIMIZER_STATE_BYTES``; 8, AdamW's two float32 moments, for an optimizer it does not know).

    Returns:
        A ``MemoryEstimate``; ``.total`` is the peak in bytes.
    """
    m = config.model
    B = config.batch_size if batch_size is None else batch_size
    ckpt = config.activation_checkpointing if checkpointing is None else checkpointing
    T, L, D, V, F, H = config.data.seq_len, m.n_layers, m.d_model, m.vocab_size, m.d_ff, m.n_heads
    dkv = m.kv_heads * m.dim_per_head
    autocast = config.precision == "bf16-autocast"
    r = 4  # parameters and the residual stream stay float32 (autocast casts per op)
    a = 2 if autocast else 4
    tokens = B * T
    if autocast:
        per_token = r * 2 * D + a * (7 * D + 2 * dkv + 3 * F) + 4 * H + 8
    else:
        per_token = r * (6 * D + 2 * dkv + 3 * F) + 4 * H + 12
    per_layer = tokens * per_token
    activations = L * tokens * r * D if ckpt else L * per_layer
    activations += tokens * (r * D * 3 + 8 * 2)  # embeddings out, final norm in/out; ids and targets (int64)
    block, copies = _LOSS_BLOCK["cuda" if device_type == "cuda" else "cpu"]
    rows = min(tokens, max(1, block // max(V, 1)))
    loss = rows * V * 4 * copies + tokens * D * 4 + V * D * 4  # logits block(s), d_hidden, d_weight (float32)
    # the backward of one layer: gradients of its saved activations, about one layer's saved set again
    workspace = per_layer
    weights = num_params * r
    grads = num_params * r
    per_param = optimizer_bytes_per_param
    if per_param is None:
        per_param = OPTIMIZER_STATE_BYTES.get(config.optimizer.name, 8)
    optimizer = int(num_params * per_param)
    copies_bf16 = num_params * 2 if autocast else 0
    forward_end = (weights + optimizer + copies_bf16 + activations + loss + workspace
                   + (grads if config.grad_accum > 1 else 0))
    backward_end = weights + grads + optimizer + loss
    return MemoryEstimate(weights=weights, grads=grads if config.grad_accum > 1 or backward_end > forward_end else 0,
                          optimizer=optimizer, weight_copies=copies_bf16, activations=activations,
                          per_layer=per_layer, loss=loss, workspace=workspace, total=max(forward_end, backward_end))


def propose_fit(config: TrainConfig, num_params: int, available: int, *, device_type: str = "cuda") -> str:
    """A change that fits ``available`` bytes at the same tokens per optimizer step, when there is one.

    Tries, in order: a smaller batch with ``grad_accum`` raised to keep ``batch_size x grad_accum``;
    activation checkpointing at the configured batch; both. Returns a sentence (empty when nothing fits:
    then the weights and optimizer states alone are too large).
    """
    B, accum = config.batch_size, config.grad_accum
    fits = [(b, False) for b in _divisors_desc(B) if b < B] + [(b, True) for b in _divisors_desc(B)]
    for b, ckpt in sorted(fits, key=lambda x: (x[1] and x[0] < B, x[1], -x[0])):
        if ckpt and config.activation_checkpointing and b == B:
            continue
        need = plan_memory(config, num_params, device_type=device_type, batch_size=b, checkpointing=ckpt or None)
        if need.total <= available:
            parts = []
            if b != B:
                parts.append(f"batch_size = {b} with grad_accum = {accum * B // b} (same tokens per step)")
            if ckpt and not config.activation_checkpointing:
                parts.append("activation_checkpointing = true")
            return " and ".join(parts) + f": about {_size(need.total)}"
    return ""


def _divisors_desc(n: int) -> list[int]:
    return sorted({d for i in range(1, math.isqrt(n) + 1) if n % i == 0 for d in (i, n // i)}, reverse=True)
