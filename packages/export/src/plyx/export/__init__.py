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

from plyx.export._api import available_formats, export, export_metadata, export_onnx, exporter, fire_export_written
from plyx.export._errors import ExportError, ExportHookError, ExportVerificationError
from plyx.export._kernels import reference_kernels
from plyx.export._onnx import CONFIG_FILE, DEFAULT_OPSET, MANIFEST_FILE, MODEL_FILE
from plyx.export._quantize import QUANTIZE_MODES
from plyx.export._result import ExportResult, GreedyCheck, ShapeCheck, VerificationReport
from plyx.export._verify import DEFAULT_TOLERANCES, verify_onnx
from plyx.export._verify_kv import DEFAULT_GREEDY_TOKENS, KVSession, verify_kv

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
