"""The process's default registry: built on first use from every plugin's registration hooks."""

from __future__ import annotations

import threading
import warnings
from typing import Any

import attrs
from plyx.kernel._registry import Registry
from plyx.specs import plugins
from plyx.specs.config import KernelConfig
from plyx.specs.errors import PluginError
from plyx.specs.kernels import KernelImpl

__all__ = ["registry", "configure", "reset_registry", "populate"]

_HOOKS = ("plyx_register_kernels", "plyx_register_attention_backends")
_LOCK = threading.RLock()
_DEFAULT: Registry | None = None


class _Attributed:
    """What a plugin's hook sees: the registry, every registration credited to the plugin's distribution.

    The distribution comes from the entry point that loaded the plugin; a
    ``source`` the plugin passes (or sets on its ``KernelImpl``) is ignored, so
    no plugin can claim to be plyx-kernel and skip the conformance probe.
    """

    def __init__(self, target: Registry, source: str) -> None:
        self.__target = target
        self.__source = source

    def register(self, impl: KernelImpl, *, source: str = "") -> None:
        if isinstance(impl, KernelImpl):
            impl = attrs.evolve(impl, source=self.__source)
        self.__target.register(impl)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.__target, name)


def populate(target: Registry) -> Registry:
    """Call ``plyx_register_kernels`` and ``plyx_register_attention_backends`` of every plugin on ``target``.

    Each implementation is attributed to the distribution of the plugin that
    registered it. A hook that raises is skipped with a warning naming its
    distribution (``PLYX_STRICT_PLUGINS=1`` raises).
    """
    pm = plugins.get_plugin_manager()
    strict = plugins._truthy("PLYX_STRICT_PLUGINS")
    for hook in _HOOKS:
        for impl in reversed(getattr(pm.hook, hook).get_hookimpls()):
            source = plugins.source_of(impl.plugin_name)
            kwargs = {"registry": _Attributed(target, source)}
            try:
                impl.function(**{k: v for k, v in kwargs.items() if k in impl.argnames})
            except Exception as exc:  # a third-party hook may fail in any way
                error = PluginError(impl.plugin_name, source, f"{hook} raised {type(exc).__name__}: {exc}")
                if strict:
                    raise error from exc
                warnings.warn(f"{error}; its kernels are skipped (set PLYX_STRICT_PLUGINS=1 to raise)",
                              plugins.PluginWarning, stacklevel=2)
    return target


def registry() -> Registry:
    """The process's default ``KernelRegistry``, populated from every plugin on first use.

    Example::

        from plyx.kernel import registry
        y = registry().get("rmsnorm", x)(x, weight, eps=1e-5)
    """
    global _DEFAULT
    if _DEFAULT is None:
        with _LOCK:
            if _DEFAULT is None:
                _DEFAULT = populate(Registry())
    return _DEFAULT


def configure(config: KernelConfig) -> Registry:
    """Apply a ``KernelConfig`` (overrides, disabled, strict) to the default registry and return it."""
    reg = registry()
    reg.configure(config)
    return reg


def reset_registry() -> None:
    """Forget the default registry; the next ``registry()`` builds it again (after installing or registering a plugin)."""
    global _DEFAULT
    with _LOCK:
        _DEFAULT = None
