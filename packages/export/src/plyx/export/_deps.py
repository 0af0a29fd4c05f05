"""The ``onnx`` extra: onnx, onnxscript (torch's dynamo exporter) and onnxruntime (verification)."""

from __future__ import annotations

import importlib
from types import ModuleType

from plyx.export._errors import ExportError

__all__ = ["require", "version_of"]

_WHY = {
    "onnx": "to check and save the graph",
    "onnxscript": "torch.onnx's dynamo exporter translates the graph with it",
    "onnxruntime": "to verify the exported graph against the torch model",
}


def require(module: str) -> ModuleType:
    """Import ``module`` or raise an ``ExportError`` that says how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ExportError(
            "format", f"ONNX export needs the {module!r} package ({_WHY.get(module, 'ONNX support')}), "
            f"which cannot be imported: {exc}", value="onnx",
            fix="install the extra: pip install 'plyx-export[onnx]'",
        ) from exc


def version_of(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "unknown"
