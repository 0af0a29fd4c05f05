"""plyx-specs: the contracts every plyx plane speaks (no torch).

Importing this package scans no plugins; ``get_plugin_manager()`` does, once.
"""

from plyx.specs.batch import Batch
from plyx.specs.checkpoint import Checkpoint, ModelCard, TensorEntry
from plyx.specs.components import CliCommand, Component
from plyx.specs.config import (
    ConfigBase,
    DataConfig,
    DistConfig,
    KernelConfig,
    ModelConfig,
    OptimizerConfig,
    RopeScaling,
    ScheduleConfig,
    ServeConfig,
    TrainConfig,
    dump_config,
    load_config,
    migration,
)
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
from plyx.specs.kernels import (
    Candidate,
    Capability,
    KernelImpl,
    KernelNotFoundError,
    KernelQuery,
    KernelRegistry,
    KernelUnavailableError,
)
from plyx.specs.kvcache import BlockTable, CacheFullError, CacheLayout, CacheUsage, KVCache
from plyx.specs.plugins import components, get_plugin_manager, plugin_report, register_plugin
from plyx.specs.strategy import TrainStrategy
from plyx.specs.tensorspec import TensorSpec, bind, dtype_name

__all__ = [
    "Batch",
    "BlockTable",
    "CacheFullError",
    "CacheLayout",
    "CacheUsage",
    "Candidate",
    "Capability",
    "Checkpoint",
    "CliCommand",
    "Component",
    "ConfigBase",
    "ConfigError",
    "ContractError",
    "DataConfig",
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
