"""The ``KernelRegistry`` contract: implementations under symbolic names, chosen by capability.

Pure Python (no torch). ``plyx-kernel`` implements the registry; any
distribution contributes implementations through the ``plyx_register_kernels``
hook. Selection: every implementation of a name is checked against the query
(device, dtype, compute capability, shape limits, importable modules); among
those whose predicates hold, the highest priority wins, ties broken by
implementation name so the choice is deterministic.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import attrs
from plyx.specs._versions import CONTRACT_VERSIONS
from plyx.specs.errors import PlyxError

__all__ = [
    "CONTRACT_VERSION",
    "KERNEL_NAMES",
    "Capability",
    "Candidate",
    "KernelImpl",
    "KernelNotFoundError",
    "KernelQuery",
    "KernelRegistry",
    "KernelUnavailableError",
]

CONTRACT_VERSION = CONTRACT_VERSIONS["kernels"]

#: the names every registry knows; plugins may add others
KERNEL_NAMES = (
    "matmul",
    "rmsnorm",
    "swiglu",
    "rope",
    "cross_entropy",
    "linear_cross_entropy",
    "attention",
    "paged_attention",
)


class KernelNotFoundError(PlyxError, LookupError):
    """No kernel or implementation of that name is registered."""


class KernelUnavailableError(PlyxError, RuntimeError):
    """Implementations exist but none (or not the one forced) accepts the query."""


def _frozen_map(value: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return dict(value or {})


@attrs.frozen
class KernelQuery:
    """What a caller needs a kernel for.

    Attributes:
        device_type: ``cpu``, ``cuda``, ``mps``...
        dtype: canonical dtype name (``bfloat16``).
        compute_capability: ``(9, 0)`` for an H100; None off CUDA.
        shape: named sizes the predicates may limit (``head_dim``, ``hidden``, ``vocab``...).
        requires_grad: whether a backward pass will be needed.
    """

    device_type: str
    dtype: str
    compute_capability: tuple[int, int] | None = None
    shape: Mapping[str, int] = attrs.field(factory=dict, converter=_frozen_map)
    requires_grad: bool = False

    def shape_class(self) -> tuple[tuple[str, int], ...]:
        """Sizes rounded up to powers of two: the selection cache key's shape part."""
        return tuple(sorted((k, 1 << max(int(v) - 1, 0).bit_length()) for k, v in self.shape.items()))

    def cache_key(self) -> tuple[Any, ...]:
        return (self.device_type, self.dtype, self.compute_capability, self.shape_class(), self.requires_grad)


@attrs.frozen
class Capability:
    """Predicates an implementation declares; ``refusal`` says why a query is refused.

    Attributes:
        devices: device types it runs on; empty means any.
        dtypes: dtype names it accepts; empty means any.
        min_compute_capability / max_compute_capability: inclusive CUDA range.
        shape_limits: name -> (min or None, max or None), inclusive.
        shape_multiple_of: name -> the size must be a multiple of this.
        shape_in: name -> allowed values (e.g. head_dim in {64, 128}).
        requires: importable modules needed (``triton``).
        backward: whether it provides gradients.
        check: extra predicate returning a refusal reason or None.
    """

    devices: frozenset[str] = attrs.field(factory=frozenset, converter=frozenset)
    dtypes: frozenset[str] = attrs.field(factory=frozenset, converter=frozenset)
    min_compute_capability: tuple[int, int] | None = None
    max_compute_capability: tuple[int, int] | None = None
    shape_limits: Mapping[str, tuple[int | None, int | None]] = attrs.field(factory=dict, converter=_frozen_map)
    shape_multiple_of: Mapping[str, int] = attrs.field(factory=dict, converter=_frozen_map)
    shape_in: Mapping[str, frozenset[int]] = attrs.field(factory=dict, converter=_frozen_map)
    requires: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    backward: bool = True
    check: Callable[[KernelQuery], str | None] | None = attrs.field(default=None, eq=False)

    def refusal(self, query: KernelQuery) -> str | None:
        """None when the implementation accepts ``query``, else the reason it refuses."""
        if self.devices and query.device_type not in self.devices:
            return f"device {query.device_type!r} not in {sorted(self.devices)}"
        if self.dtypes and query.dtype not in self.dtypes:
            return f"dtype {query.dtype} not in {sorted(self.dtypes)}"
        cc = query.compute_capability
        if self.min_compute_capability is not None and (cc is None or cc < self.min_compute_capability):
            return f"compute capability {cc} below {self.min_compute_capability}"
        if self.max_compute_capability is not None and cc is not None and cc > self.max_compute_capability:
            return f"compute capability {cc} above {self.max_compute_capability}"
        if query.requires_grad and not self.backward:
            return "has no backward pass and gradients are required"
        for name, (low, high) in self.shape_limits.items():
            size = query.shape.get(name)
            if size is None:
                continue
            if low is not None and size < low:
                return f"{name}={size} below the minimum {low}"
            if high is not None and size > high:
                return f"{name}={size} above the maximum {high}"
        for name, multiple in self.shape_multiple_of.items():
            size = query.shape.get(name)
            if size is not None and size % multiple:
                return f"{name}={size} is not a multiple of {multiple}"
        for name, allowed in self.shape_in.items():
            size = query.shape.get(name)
            if size is not None and size not in allowed:
                return f"{name}={size} not in {sorted(allowed)}"
        for module in self.requires:
            if importlib.util.find_spec(module) is None:
                return f"module {module!r} is not installed"
        if self.check is not None:
            return self.check(query)
        return None


@attrs.frozen
class KernelImpl:
    """One implementation of a kernel name.

    Attributes:
        name: the symbolic kernel name (``rmsnorm``).
        impl: the implementation's name, unique per kernel name (``triton``, ``reference``).
        fn: the callable; its signature is the kernel name's (documented by plyx-kernel).
        capability: predicates that must hold for it to be chosen.
        priority: higher wins among accepted candidates; the reference uses 0.
        description: one line shown by ``plyx kernels list``.
        source: the distribution that registered it (filled in by the registry).
    """

    name: str
    impl: str
    fn: Callable[..., Any] = attrs.field(eq=False)
    capability: Capability = attrs.field(factory=Capability)
    priority: int = 0
    description: str = ""
    source: str = ""

    @property
    def qualname(self) -> str:
        return f"{self.name}:{self.impl}"


@attrs.frozen
class Candidate:
    """One line of an explanation: an implementation, whether it was taken, and why."""

    impl: KernelImpl
    taken: bool
    reason: str


@runtime_checkable
class KernelRegistry(Protocol):
    """Where implementations are registered and chosen."""

    def register(self, impl: KernelImpl, *, source: str = "") -> None:
        """Add ``impl``; a second implementation with the same (name, impl) is an error naming both sources."""
        ...

    def names(self) -> list[str]:
        """Every kernel name with at least one implementation, sorted."""
        ...

    def implementations(self, name: str) -> list[KernelImpl]:
        """The implementations of ``name``, highest priority first."""
        ...

    def select(self, name: str, query: KernelQuery) -> KernelImpl:
        """The implementation used for ``query`` (overrides first, then priority); cached per shape class."""
        ...

    def explain(self, name: str, query: KernelQuery) -> list[Candidate]:
        """Every candidate of ``name`` for ``query``, with taken/refused and why."""
        ...

    def get(self, name: str, *tensors: Any, **shape: int) -> Callable[..., Any]:
        """The callable selected for the device and dtype of ``tensors`` and the named sizes."""
        ...

    def override(self, **choices: str) -> AbstractContextManager[None]:
        """Force ``name=impl`` choices inside a ``with`` block."""
        ...

    def __iter__(self) -> Iterator[KernelImpl]: ...
