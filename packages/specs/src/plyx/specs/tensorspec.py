"""``TensorSpec``: the shape, dtype and layout a kernel or module expects.

Dimensions are integers (fixed), names (symbolic, bound across tensors) or
``None`` (anything). Validation works on any object with ``.shape`` and
``.dtype`` (torch tensors, numpy arrays) without importing torch.

Example::

    q = TensorSpec(("B", "T", "H", "Dh"), dtype=("bfloat16", "float16"))
    mask = TensorSpec(("B", "T"), dtype="bool")
    dims = bind(q=(q, q_tensor), mask=(mask, mask_tensor))   # {"B": 2, "T": 128, ...}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, Union

import attrs
from plyx.specs._versions import CONTRACT_VERSIONS
from plyx.specs.errors import TensorSpecError

__all__ = ["TensorSpec", "Dim", "bind", "dtype_name", "CONTRACT_VERSION"]

CONTRACT_VERSION = CONTRACT_VERSIONS["tensorspec"]

#: a fixed size, a symbolic name, or None for "any size"
Dim = Union[int, str, None]

_DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
    "fp64": "float64",
    "double": "float64",
    "long": "int64",
    "int": "int32",
    "bool_": "bool",
}


def dtype_name(dtype: Any) -> str:
    """Canonical dtype name of a torch dtype, numpy dtype or string (``torch.bfloat16`` -> ``bfloat16``)."""
    name = getattr(dtype, "name", None)  # numpy
    if not isinstance(name, str):
        name = str(dtype)
    name = name.removeprefix("torch.")
    return _DTYPE_ALIASES.get(name, name)


def _dtypes(value: str | tuple[str, ...] | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = (value,)
    return tuple(dtype_name(v) for v in value)


def _is_contiguous(obj: Any) -> bool | None:
    method = getattr(obj, "is_contiguous", None)
    if callable(method):
        return bool(method())
    flags = getattr(obj, "flags", None)  # numpy
    if flags is not None:
        return bool(flags["C_CONTIGUOUS"])
    return None


@attrs.frozen(kw_only=False)
class TensorSpec:
    """What one tensor must look like.

    Attributes:
        shape: one entry per dimension: int (fixed), str (symbolic, bound by
            name), or None (any). A leading ``"..."`` admits any number of
            leading dimensions.
        dtype: allowed dtype names (``"bfloat16"``, ``("float16", "bfloat16")``); None admits any.
        layout: ``"contiguous"`` (row-major, dense) or ``"any"`` (strides unchecked).
        name: used in errors when no name is given to ``validate``.
    """

    shape: tuple[Dim, ...] = attrs.field(converter=tuple)
    dtype: tuple[str, ...] | None = attrs.field(default=None, converter=_dtypes)
    layout: Literal["contiguous", "any"] = attrs.field(
        default="any", validator=attrs.validators.in_(("contiguous", "any"))
    )
    name: str = "tensor"

    @property
    def rank(self) -> int | None:
        """Number of dimensions, or None when a leading ``...`` admits any."""
        return None if self.shape[:1] == ("...",) else len(self.shape)

    def validate(
        self, tensor: Any, bindings: Mapping[str, int] | None = None, *, name: str | None = None
    ) -> dict[str, int]:
        """Check ``tensor`` and return ``bindings`` extended with the symbols it fixes.

        Raises:
            TensorSpecError: naming the tensor, the dimension and both sizes.
        """
        label = name or self.name
        shape = getattr(tensor, "shape", None)
        if shape is None or not hasattr(tensor, "dtype"):
            raise TensorSpecError(label, f"expected a tensor with .shape and .dtype, got {type(tensor).__name__}")
        actual = tuple(int(s) for s in shape)
        spec = self.shape
        if spec[:1] == ("...",):
            spec = spec[1:]
            if len(actual) < len(spec):
                raise TensorSpecError(
                    label, f"expected at least {len(spec)} dims {self._fmt(spec)}, got shape {list(actual)}"
                )
            actual = actual[len(actual) - len(spec) :]
        elif len(actual) != len(spec):
            raise TensorSpecError(
                label, f"expected {len(spec)} dims {self._fmt(spec)}, got {len(actual)} dims (shape {list(actual)})"
            )
        bound = dict(bindings or {})
        for axis, (want, got) in enumerate(zip(spec, actual, strict=True)):
            if want is None:
                continue
            if isinstance(want, int):
                if got != want:
                    raise TensorSpecError(label, f"dim {axis} must be {want}, got {got} (shape {list(actual)})")
                continue
            if want in bound and bound[want] != got:
                raise TensorSpecError(
                    label,
                    f"dim {axis} ({want}) is {got}, but {want}={bound[want]} was bound by an earlier tensor "
                    f"(shape {list(actual)})",
                )
            bound[want] = got
        if self.dtype is not None:
            got_dtype = dtype_name(tensor.dtype)
            if got_dtype not in self.dtype:
                raise TensorSpecError(
                    label, f"dtype must be one of {', '.join(self.dtype)}, got {got_dtype}; convert it with .to()"
                )
        if self.layout == "contiguous" and _is_contiguous(tensor) is False:
            raise TensorSpecError(label, "must be contiguous; call .contiguous() on it first")
        return bound

    @staticmethod
    def _fmt(spec: tuple[Dim, ...]) -> str:
        return "[" + ", ".join("_" if d is None else str(d) for d in spec) + "]"


def bind(
    tensors: Mapping[str, tuple[TensorSpec, Any]] | None = None, /, **named: tuple[TensorSpec, Any]
) -> dict[str, int]:
    """Validate several tensors together; a symbol must have one size across all of them.

    Returns the bindings (``{"B": 2, "T": 128, ...}``). Optional tensors may be
    passed as ``(spec, None)`` and are skipped.
    """
    items = dict(tensors or {}, **named)
    bound: dict[str, int] = {}
    for label, (spec, tensor) in items.items():
        if tensor is None:
            continue
        bound = spec.validate(tensor, bound, name=label)
    return bound
