"""plyx-model: the TransformerLM (Llama, Qwen2/3, Mistral; MoE: Mixtral, Qwen2/3-MoE, OLMoE), checkpoints, layer
streaming, Hugging Face interop and adapters (``plyx.model.adapters``: LoRA, rsLoRA, DoRA, PEFT interop, NEFTune) and draft heads for speculative decoding
(Medusa, EAGLE)."""

from typing import Any

__all__ = [
    "ARCHITECTURES",
    "CheckpointDir",
    "CheckpointError",
    "CheckpointIntegrityError",
    "CheckpointMismatchError",
    "DRAFT_KINDS",
    "DraftHeadsError",
    "EagleDraft",
    "LayerStreamer",
    "LoraConfig",
    "MedusaHeads",
    "ROUTER_METRICS",
    "SparseMoE",
    "TransformerLM",
    "UnsupportedArchitectureError",
    "add_adapter",
    "build_draft_heads",
    "config_from_hf",
    "config_to_hf",
    "disable_adapters",
    "load_checkpoint",
    "load_draft_heads",
    "load_balancing_loss",
    "load_hf",
    "load_peft",
    "merge_and_unload",
    "neftune",
    "open_checkpoint",
    "router_z_loss",
    "save_checkpoint",
    "save_draft_heads",
    "save_hf",
    "save_peft",
    "set_adapter",
    "stream_forward",
]


def __getattr__(name: str) -> Any:
    """Load the public names on first use (PEP 562).

    Importing ``plyx.model`` (and so its plugin entry point, ``plyx.model._plugin``)
    imports nothing heavy: ``plyx --help`` and ``plyx plugins`` never load torch.
    The names live in ``plyx.model._exports``.
    """
    if name in __all__:
        from plyx.model import _exports

        value = getattr(_exports, name)
        globals()[name] = value  # later lookups are plain attribute reads
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
