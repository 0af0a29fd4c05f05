"""plyx-model: the TransformerLM (Llama, Qwen2/3, Mistral; MoE: Mixtral, Qwen2/3-MoE, OLMoE), checkpoints, layer
streaming, Hugging Face interop and adapters (``plyx.model.adapters``: LoRA, rsLoRA, DoRA, PEFT interop, NEFTune)."""

from plyx.model._checkpoint import (
    CheckpointDir,
    load_checkpoint,
    load_hf,
    open_checkpoint,
    save_checkpoint,
    save_hf,
)
from plyx.model._errors import (
    CheckpointError,
    CheckpointIntegrityError,
    CheckpointMismatchError,
    UnsupportedArchitectureError,
)
from plyx.model._hf_config import ARCHITECTURES, config_from_hf, config_to_hf
from plyx.model._model import TransformerLM
from plyx.model._moe import ROUTER_METRICS, SparseMoE, load_balancing_loss, router_z_loss
from plyx.model._streaming import LayerStreamer, stream_forward
from plyx.model.adapters import (
    LoraConfig,
    add_adapter,
    disable_adapters,
    load_peft,
    merge_and_unload,
    neftune,
    save_peft,
    set_adapter,
)

__all__ = [
    "ARCHITECTURES",
    "CheckpointDir",
    "CheckpointError",
    "CheckpointIntegrityError",
    "CheckpointMismatchError",
    "LayerStreamer",
    "LoraConfig",
    "ROUTER_METRICS",
    "SparseMoE",
    "TransformerLM",
    "UnsupportedArchitectureError",
    "add_adapter",
    "config_from_hf",
    "config_to_hf",
    "disable_adapters",
    "load_checkpoint",
    "load_balancing_loss",
    "load_hf",
    "load_peft",
    "merge_and_unload",
    "neftune",
    "open_checkpoint",
    "router_z_loss",
    "save_checkpoint",
    "save_hf",
    "save_peft",
    "set_adapter",
    "stream_forward",
]
