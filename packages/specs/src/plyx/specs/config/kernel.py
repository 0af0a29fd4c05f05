"""``KernelConfig``: how the kernel registry chooses implementations."""

from __future__ import annotations

from typing import Any

from plyx.specs.config._base import ConfigBase
from plyx.specs.errors import ConfigError

__all__ = ["KernelConfig"]


class KernelConfig(ConfigBase, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Overrides and policy of kernel selection.

    The ``PLYX_KERNELS`` environment variable (``rmsnorm=reference,rope=triton``)
    has the same meaning as ``overrides`` and wins over it.
    """

    SCHEMA = "kernel"
    VERSION = 1

    overrides: dict[str, str] = {}
    """Kernel name -> implementation name to use whatever the priorities say."""
    disabled: list[str] = []
    """Implementation names (``triton``, ``name:impl``) never to select."""
    strict: bool = False
    """Raise instead of falling back when an override's predicates do not hold."""

    def check(self) -> None:
        for name, impl in self.overrides.items():
            if not name or not impl:
                raise ConfigError(
                    f"overrides.{name or '<empty>'}",
                    "an override needs a kernel name and an implementation name",
                    value=impl,
                    fix='write it as {"rmsnorm": "reference"}',
                )

    @staticmethod
    def parse_env(value: str) -> dict[str, Any]:
        """Parse ``PLYX_KERNELS`` (``name=impl,name=impl``) into overrides."""
        out: dict[str, str] = {}
        for item in filter(None, (part.strip() for part in value.split(","))):
            name, sep, impl = item.partition("=")
            if not sep or not name.strip() or not impl.strip():
                raise ConfigError(
                    "PLYX_KERNELS",
                    f"cannot read {item!r}",
                    value=value,
                    fix="write PLYX_KERNELS=rmsnorm=reference,rope=triton",
                )
            out[name.strip()] = impl.strip()
        return out
