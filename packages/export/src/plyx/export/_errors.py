"""Errors of plyx-export: each names the argument, the value, what was expected and the fix."""

from __future__ import annotations

from typing import Any

from plyx.specs.errors import PlyxError, describe

__all__ = ["ExportError", "ExportHookError", "ExportVerificationError"]


class ExportError(PlyxError, ValueError):
    """An export cannot be made as asked (bad argument, missing extra, tracing failure).

    Attributes:
        field: the argument or option at fault (``format``, ``out_dir``, ``opset``...).
        problem: what is wrong.
        value: the offending value (None when not applicable).
        fix: how to make it right.
    """

    def __init__(self, field: str, problem: str, *, value: Any = None, fix: str = "") -> None:
        self.field = field
        self.problem = problem
        self.value = value
        self.fix = fix
        super().__init__(describe(field, problem, value=value, fix=fix))


class ExportVerificationError(ExportError):
    """The exported graph's logits differ from the torch model's beyond the tolerance.

    Attributes:
        report: the ``VerificationReport`` with every shape checked.
    """

    def __init__(self, problem: str, *, report: Any, fix: str = "") -> None:
        self.report = report
        super().__init__("verify", problem, fix=fix)


class ExportHookError(ExportError):
    """The export was written, but a ``plyx_on_export_written`` implementation raised.

    Attributes:
        result: the ``ExportResult`` that was written (the files stay in place).
    """

    def __init__(self, problem: str, *, result: Any, fix: str = "") -> None:
        self.result = result
        super().__init__("plyx_on_export_written", problem, fix=fix)
