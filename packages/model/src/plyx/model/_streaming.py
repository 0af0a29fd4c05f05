"""Layer-streaming forward: run a model whose weights stay on disk (or in CPU memory), one layer at a time.

Only the embedding, the final norm and the LM head stay resident; each decoder
layer is materialised on the compute device right before it runs and freed
right after, so peak memory is one layer plus activations, whatever the depth
(``packages/model/bench/streaming_memory.py`` measures it). The math is the
bulk forward's (the same ``DecoderLayer`` code), so logits agree to float
tolerance; a KV cache works as in the bulk forward.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import torch
from plyx.model._checkpoint import CheckpointDir, open_checkpoint
from plyx.model._model import DecoderLayer, TransformerLM, torch_dtype

__all__ = ["LayerStreamer", "stream_forward"]

_RESIDENT = ("embed_tokens.", "norm.", "lm_head.")


class LayerStreamer:
    """Runs ``TransformerLM.forward`` with decoder layers loaded one at a time.

    Args:
        source: a checkpoint directory (plyx or Hugging Face; weights stay on disk and
            each layer is read from its shard when needed) or a ``TransformerLM``
            (weights stay where they are, typically CPU memory, and each layer is
            copied to ``device`` when needed).
        device: where the compute runs.
        dtype: compute dtype (default: the model's).
        verify: check the checkpoint's sizes and digests once, up front.

    Attributes:
        max_resident_layers: the most decoder layers materialised at once so far (1 when streaming works).

    Example::

        streamer = LayerStreamer("checkpoints/llama-70b", device="cuda", dtype="bfloat16")
        logits = streamer(input_ids)
    """

    def __init__(self, source: str | os.PathLike[str] | CheckpointDir | TransformerLM, *, device: Any = "cpu",
                 dtype: Any = None, verify: bool = True) -> None:
        self.device = torch.device(device)
        if isinstance(source, TransformerLM):
            self._ckpt: CheckpointDir | None = None
            self._model: TransformerLM | None = source
            config = source.config
        else:
            self._ckpt = source if isinstance(source, CheckpointDir) else open_checkpoint(source)
            self._model = None
            from plyx.model._checkpoint import check_tensors

            config = self._ckpt.config
            check_tensors(self._ckpt, config)
            if verify:
                self._ckpt.verify()
        self.config = config
        # the compute dtype may be one a ModelConfig does not name (float64 for checks)
        self.dtype = torch_dtype(dtype if dtype is not None else config.dtype)
        # skeleton: every parameter on meta, then the resident ones made real
        self.skeleton = TransformerLM(config, device="meta")
        resident = {n: t for n, t in self._source_tensors(_RESIDENT).items()}
        self.skeleton.load_state_dict(resident, strict=False, assign=True)
        self._alive: weakref.WeakSet[DecoderLayer] = weakref.WeakSet()
        self.max_resident_layers = 0

    def _source_tensors(self, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
        if self._model is not None:
            state = self._model.state_dict()
            names = [n for n in state if n.startswith(prefixes)]
            return {n: state[n].to(device=self.device, dtype=self.dtype, copy=True) for n in names}
        assert self._ckpt is not None
        names = [n for n in self._ckpt.tensor_names() if n.startswith(prefixes)]
        loaded = self._ckpt.load_tensors(names, device=str(self.device))
        return {n: t.to(dtype=self.dtype) for n, t in loaded.items()}

    def load_layer(self, index: int) -> DecoderLayer:
        """Materialise decoder layer ``index`` on the compute device."""
        prefix = f"layers.{index}."
        state = {n[len(prefix):]: t for n, t in self._source_tensors((prefix,)).items()}
        layer = DecoderLayer(self.config, index, device="meta", dtype=self.dtype)
        layer.load_state_dict(state, strict=True, assign=True)
        self._alive.add(layer)
        self.max_resident_layers = max(self.max_resident_layers, len(self._alive))
        return layer

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """Same arguments and result as ``TransformerLM.forward`` (inference only: no gradients)."""
        return_hidden = kwargs.pop("return_hidden", False)
        h, cos, sin, attn = self.skeleton._prologue(
            input_ids,
            kwargs.pop("position_ids", None),
            kwargs.pop("document_ids", None),
            kwargs.pop("attention_mask", None),
            kwargs.pop("cache", None),
            kwargs.pop("seq_ids", None),
        )
        if kwargs:
            raise TypeError(f"unexpected arguments {sorted(kwargs)}; LayerStreamer takes TransformerLM.forward's")
        for index in range(self.config.n_layers):
            layer = self.load_layer(index)
            h = layer(h, cos, sin, **attn)
            del layer  # the only reference: its weights are freed before the next layer loads
        return self.skeleton._epilogue(h, return_hidden)


def stream_forward(source: Any, input_ids: torch.Tensor, *, device: Any = "cpu", dtype: Any = None,
                   **kwargs: Any) -> torch.Tensor:
    """One layer-streamed forward of ``source`` (a checkpoint path or a ``TransformerLM``); see ``LayerStreamer``."""
    return LayerStreamer(source, device=device, dtype=dtype)(input_ids, **kwargs)
