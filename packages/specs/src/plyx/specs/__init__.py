"""plyx-specs: the contracts every plyx plane speaks (no torch).

Importing this package scans no plugins; ``get_plugin_manager()`` does, once.
The contracts' names load on first use (PEP 562), so a plugin module's
``from plyx.specs import hookimpl`` costs only the plugin surface.
"""

import importlib
from typing import Any

# the plugin surface is bound eagerly (every plugin module imports it; it is light: attrs and pluggy) ...
from plyx.specs.components import CliCommand, Component
from plyx.specs.errors import (
    ConfigError,
    ContractError,
    IncompatiblePluginError,
    PluginConflictError,
    PluginError,
    PlyxError,
    TensorSpecError,
)
from plyx.specs.hookspecs import hookimpl, hookspec
from plyx.specs.plugins import components, get_plugin_manager, plugin_report, register_plugin

# ... the contracts load on first use (msgspec configs, checkpoints, TensorSpec): `plyx --help` needs none of them
_LAZY = {
    "Batch": "batch",
    "Checkpoint": "checkpoint", "ModelCard": "checkpoint", "TensorEntry": "checkpoint",
    **dict.fromkeys(("CardConfig", "ConfigBase", "DataConfig", "DistConfig", "DraftConfig", "KernelConfig", "ModelConfig", "OptimizerConfig", "RopeScaling",
                     "ScheduleConfig", "ServeConfig", "TrainConfig", "dump_config", "load_config", "migration"),
                    "config"),
    **dict.fromkeys(("Candidate", "Capability", "KernelImpl", "KernelNotFoundError", "KernelQuery", "KernelRegistry",
                     "KernelUnavailableError"), "kernels"),
    **dict.fromkeys(("BlockTable", "CacheFullError", "CacheLayout", "CacheUsage", "KVCache"), "kvcache"),
    **dict.fromkeys(("TensorSpec", "bind", "dtype_name"), "tensorspec"),
    "TrainStrategy": "strategy",
}

__all__ = [
    "Batch",
    "BlockTable",
    "CacheFullError",
    "CacheLayout",
    "CacheUsage",
    "Candidate",
    "Capability",
    "CardConfig",
    "Checkpoint",
    "CliCommand",
    "Component",
    "ConfigBase",
    "ConfigError",
    "ContractError",
    "DataConfig",
    "DraftConfig",
    "DistConfig",
    "IncompatiblePluginError",
    "KVCache",
    "KernelConfig",
    "KernelImpl",
    "KernelNotFoundError",
    "KernelQuery",
    "KernelRegistry",
    "KernelUnavailableError",
    "ModelCard",
    "ModelConfig",
    "OptimizerConfig",
    "PluginConflictError",
    "PluginError",
    "PlyxError",
    "RopeScaling",
    "ScheduleConfig",
    "ServeConfig",
    "TensorEntry",
    "TensorSpec",
    "TensorSpecError",
    "TrainConfig",
    "TrainStrategy",
    "bind",
    "components",
    "dtype_name",
    "dump_config",
    "get_plugin_manager",
    "hookimpl",
    "hookspec",
    "load_config",
    "migration",
    "plugin_report",
    "register_plugin",
]


def __getattr__(name: str) -> Any:
    """Load a contract's names (or a submodule, as ``plyx.specs.config``) on first use."""
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
        globals()[name] = value
        return value
    if not name.startswith("_"):
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
