"""The ``Batch`` contract: what a data pipeline yields and a model consumes."""

from __future__ import annotations

from typing import Any

import attrs
from plyx.specs._versions import CONTRACT_VERSIONS
from plyx.specs.tensorspec import TensorSpec, bind

__all__ = ["CONTRACT_VERSION", "Batch", "BATCH_SPECS"]

CONTRACT_VERSION = CONTRACT_VERSIONS["batch"]

_INT = ("int64", "int32")

#: the spec of each field; B and T are bound across all of them
BATCH_SPECS = {
    "input_ids": TensorSpec(("B", "T"), dtype=_INT, name="input_ids"),
    "targets": TensorSpec(("B", "T"), dtype=_INT, name="targets"),
    "attention_mask": TensorSpec(("B", "T"), dtype=("bool", "int64", "int32"), name="attention_mask"),
    "position_ids": TensorSpec(("B", "T"), dtype=_INT, name="position_ids"),
    "document_ids": TensorSpec(("B", "T"), dtype=_INT, name="document_ids"),
}


@attrs.frozen
class Batch:
    """One micro-batch of token sequences.

    Attributes:
        input_ids: ``[B, T]`` token ids.
        targets: ``[B, T]`` next-token ids; ``-100`` marks positions without a loss.
        attention_mask: ``[B, T]`` 1/True for real tokens, 0/False for padding; None means all real.
        position_ids: ``[B, T]`` RoPE positions (restart at each document when packed); None means 0..T-1.
        document_ids: ``[B, T]`` document index of each token in packed sequences; attention never crosses
            a document boundary. None means one document per row.
        meta: free-form provenance (shard, offset) for error messages; not part of the math.
    """

    input_ids: Any
    targets: Any
    attention_mask: Any = None
    position_ids: Any = None
    document_ids: Any = None
    meta: dict[str, Any] = attrs.field(factory=dict, eq=False)

    def validate(self) -> dict[str, int]:
        """Check every field against ``BATCH_SPECS``; returns ``{"B": ..., "T": ...}``."""
        return bind({name: (spec, getattr(self, name)) for name, spec in BATCH_SPECS.items()})

    @property
    def num_tokens(self) -> int:
        shape = self.input_ids.shape
        return int(shape[0]) * int(shape[1])

    def to(self, *args: Any, **kwargs: Any) -> Batch:
        """Move every tensor field with ``.to(*args, **kwargs)`` (device moves; dtypes stay)."""
        moved = {
            name: (value.to(*args, **kwargs) if value is not None else None)
            for name, value in ((n, getattr(self, n)) for n in BATCH_SPECS)
        }
        return Batch(**moved, meta=self.meta)
