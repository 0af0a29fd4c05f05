"""plyx-export: exports of a plyx ``TransformerLM``, each verified by its consumer, with a lifecycle hook.

Public surface:

- ``export_onnx(model, out_dir, ...)``: the prefill logits graph, or (``with_kv_cache=True``)
  the decoding graph with past/present key-values, optionally int8 (``quantize=``);
  atomically written, checked in onnxruntime, then ``plyx_on_export_written`` fired.
- ``export(model, out_dir, format=...)``: any exporter found by name through the
  ``plyx_exporters`` hook (``available_formats()``): ``onnx``, ``hf``, ``gguf`` built in.
- ``verify_onnx(path, model)`` / ``verify_kv(path, model)``: compare a graph with the torch model.
- ``KVSession``: a KV graph in onnxruntime with a greedy loop.
- ``reference_kernels()``: the kernel selection used while tracing (pure-torch references).
"""

from typing import Any

__all__ = [
    "CONFIG_FILE",
    "DEFAULT_GREEDY_TOKENS",
    "DEFAULT_OPSET",
    "DEFAULT_TOLERANCES",
    "MANIFEST_FILE",
    "MODEL_FILE",
    "ExportError",
    "ExportHookError",
    "ExportResult",
    "ExportVerificationError",
    "GreedyCheck",
    "KVSession",
    "QUANTIZE_MODES",
    "ShapeCheck",
    "VerificationReport",
    "available_formats",
    "export",
    "export_metadata",
    "export_onnx",
    "exporter",
    "fire_export_written",
    "reference_kernels",
    "verify_kv",
    "verify_onnx",
]


def __getattr__(name: str) -> Any:
    """Load the public names on first use (PEP 562).

    Importing ``plyx.export`` (and so its plugin entry point, ``plyx.export._plugin``)
    imports nothing heavy: ``plyx --help`` and ``plyx plugins`` never load torch.
    The names live in ``plyx.export._exports``.
    """
    if name in __all__:
        from plyx.export import _exports

        value = getattr(_exports, name)
        globals()[name] = value  # later lookups are plain attribute reads
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
