"""plyx-export: ONNX export of a plyx ``TransformerLM``, verified in onnxruntime, with a lifecycle hook.

Public surface:

- ``export_onnx(model, out_dir, ...)``: the prefill logits graph, atomically written,
  checked in onnxruntime, then ``plyx_on_export_written`` fired.
- ``export(model, out_dir, format=...)``: any exporter found by name through the
  ``plyx_exporters`` hook (``available_formats()``).
- ``verify_onnx(path, model)``: compare a graph with the torch model on random token ids.
- ``reference_kernels()``: the kernel selection used while tracing (pure-torch references).
"""

from plyx.export._api import available_formats, export, export_metadata, export_onnx, exporter, fire_export_written
from plyx.export._errors import ExportError, ExportHookError, ExportVerificationError
from plyx.export._kernels import reference_kernels
from plyx.export._onnx import CONFIG_FILE, DEFAULT_OPSET, MANIFEST_FILE, MODEL_FILE
from plyx.export._result import ExportResult, ShapeCheck, VerificationReport
from plyx.export._verify import DEFAULT_TOLERANCES, verify_onnx

__all__ = [
    "CONFIG_FILE",
    "DEFAULT_OPSET",
    "DEFAULT_TOLERANCES",
    "MANIFEST_FILE",
    "MODEL_FILE",
    "ExportError",
    "ExportHookError",
    "ExportResult",
    "ExportVerificationError",
    "ShapeCheck",
    "VerificationReport",
    "available_formats",
    "export",
    "export_metadata",
    "export_onnx",
    "exporter",
    "fire_export_written",
    "reference_kernels",
    "verify_onnx",
]
