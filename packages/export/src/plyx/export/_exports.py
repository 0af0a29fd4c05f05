"""The public names of ``plyx.export``, imported on first use by its ``__getattr__`` (keeps the package light)."""
# re-exports: plyx.export.__all__ names them and its __getattr__ serves them
# ruff: noqa: F401

from plyx.export._api import available_formats, export, export_metadata, export_onnx, exporter, fire_export_written
from plyx.export._errors import ExportError, ExportHookError, ExportVerificationError
from plyx.export._kernels import reference_kernels
from plyx.export._onnx import CONFIG_FILE, DEFAULT_OPSET, MANIFEST_FILE, MODEL_FILE
from plyx.export._quantize import QUANTIZE_MODES
from plyx.export._result import ExportResult, GreedyCheck, ShapeCheck, VerificationReport
from plyx.export._verify import DEFAULT_TOLERANCES, verify_onnx
from plyx.export._verify_kv import DEFAULT_GREEDY_TOKENS, KVSession, verify_kv
