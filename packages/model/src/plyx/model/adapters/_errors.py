"""Errors of the adapters: each names the adapter, module or tensor, what was found and the fix."""

from __future__ import annotations

from plyx.specs.errors import PlyxError

__all__ = ["AdapterError", "AdapterMismatchError"]


class AdapterError(PlyxError, ValueError):
    """An adapter cannot be added, switched, merged, saved or loaded as asked."""


class AdapterMismatchError(AdapterError):
    """The tensors of an adapter do not fit the model (missing, unexpected, or of another shape).

    Attributes:
        problems: one line per tensor: ``name: file [..] vs model [..]``, missing or unexpected.
    """

    def __init__(self, problems: list[str], *, source: str = "") -> None:
        self.problems = problems
        shown = "\n  ".join(problems[:20]) + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
        super().__init__(
            f"adapter {source} does not fit this model:\n  {shown}\n"
            f"check that the adapter was trained on this base model (same d_model, heads, d_ff, layers) "
            f"and with the rank and target modules its adapter_config.json names"
        )
