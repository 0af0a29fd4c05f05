"""plyx-model: the TransformerLM (Llama, Qwen2/3, Mistral), checkpoints, layer streaming and Hugging Face interop."""

from typing import Any

__all__ = [
    "ARCHITECTURES",
    "CheckpointDir",
    "CheckpointError",
    "CheckpointIntegrityError",
    "CheckpointMismatchError",
    "LayerStreamer",
    "TransformerLM",
    "UnsupportedArchitectureError",
    "config_from_hf",
    "config_to_hf",
    "load_checkpoint",
    "load_hf",
    "open_checkpoint",
    "save_checkpoint",
    "save_hf",
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
