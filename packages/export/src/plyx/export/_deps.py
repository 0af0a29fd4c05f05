"""Optional packages of the exporters, each in an extra: ``onnx``, ``hf``, ``gguf``."""

from __future__ import annotations

import importlib
from types import ModuleType

from plyx.export._errors import ExportError

__all__ = ["require", "version_of"]

_WHY = {
    "onnx": "to check and save the graph",
    "onnxscript": "torch.onnx's dynamo exporter translates the graph with it",
    "onnxruntime": "to verify the exported graph against the torch model",
    "onnxruntime.quantization": "to quantise the graph to int8",
    "tokenizers": "to tokenise calibration and sample text with the model's tokenizer",
    "transformers": "to load the export back and compare its logits with plyx's",
    "gguf": "llama.cpp's own GGUF writer and reader",
    "accelerate": "transformers' GGUF loader needs it to read the file back",
}


def require(module: str, *, extra: str = "onnx") -> ModuleType:
    """Import ``module`` or raise an ``ExportError`` that says which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ExportError(
            "format", f"{extra} export needs the {module!r} package ({_WHY.get(module, 'export support')}), "
            f"which cannot be imported: {exc}", value=extra,
            fix=f"install the extra: pip install 'plyx-export[{extra}]'",
        ) from exc


def version_of(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "unknown"
