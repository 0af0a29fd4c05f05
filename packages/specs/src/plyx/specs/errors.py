"""Error types shared by every plane.

Each error keeps its parts as attributes (what was wrong, where, and the fix)
and subclasses the built-in error a caller would naturally catch, the way
attrs and msgspec do: ``ConfigError`` is a ``ValueError``, a missing kernel is
a ``LookupError``.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "describe",
    "PlyxError",
    "ConfigError",
    "TensorSpecError",
    "PluginError",
    "PluginConflictError",
    "IncompatiblePluginError",
    "ContractError",
]


class PlyxError(Exception):
    """Base class of every error plyx raises on purpose."""


def describe(subject: str, problem: str, *, value: Any = None, fix: str = "") -> str:
    """The message every plane's errors share: ``subject: problem (got value); fix``."""
    message = f"{subject}: {problem}"
    if value is not None:
        message += f" (got {value!r})"
    if fix:
        message += f"; {fix}"
    return message


class ConfigError(PlyxError, ValueError):
    """A configuration value is missing, unknown, mistyped or out of range.

    Attributes:
        path: where the value sits, as ``$.model.n_heads``.
        value: the offending value (``None`` when the field is missing).
        problem: what is wrong with it.
        fix: how to make it right.
    """

    def __init__(self, path: str, problem: str, *, value: Any = None, fix: str = "") -> None:
        self.path = path
        self.value = value
        self.problem = problem
        self.fix = fix
        message = f"{problem} - at `{path}`"
        if value is not None:
            message += f" (got {value!r})"
        if fix:
            message += f"; {fix}"
        super().__init__(message)


class TensorSpecError(PlyxError, ValueError):
    """A tensor does not match its ``TensorSpec``.

    Attributes:
        tensor: the name of the tensor (``q``, ``mask``...).
        problem: what is wrong (shape, dimension binding, dtype, layout).
    """

    def __init__(self, tensor: str, problem: str) -> None:
        self.tensor = tensor
        self.problem = problem
        super().__init__(f"tensor `{tensor}`: {problem}")


class PluginError(PlyxError, RuntimeError):
    """A plugin could not be loaded or registered.

    Attributes:
        plugin: the entry-point name.
        distribution: the distribution that ships it (``plyx-kernel 1.0.0``).
    """

    def __init__(self, plugin: str, distribution: str, problem: str) -> None:
        self.plugin = plugin
        self.distribution = distribution
        self.problem = problem
        super().__init__(f"plugin {plugin!r} from {distribution}: {problem}")


class IncompatiblePluginError(PluginError):
    """A plugin declares a contract version this plyx-specs does not provide."""


class PluginConflictError(PlyxError, RuntimeError):
    """Two distributions register plugins under the same name."""

    def __init__(self, plugin: str, first: str, second: str) -> None:
        self.plugin = plugin
        self.distributions = (first, second)
        super().__init__(
            f"two plugins are named {plugin!r}: one from {first} and one from {second}; "
            f"uninstall one of them or rename its entry point in the `plyx` group"
        )


class ContractError(PlyxError, RuntimeError):
    """A frozen contract changed in a way that is not purely additive."""
