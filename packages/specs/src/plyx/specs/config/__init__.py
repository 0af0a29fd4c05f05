"""Versioned configuration schemas: load/dump JSON, TOML, YAML with migrations."""

from plyx.specs.config._base import (
    FORMATS,
    ConfigBase,
    dump_config,
    load_config,
    migration,
    migrations_for,
)
from plyx.specs.config.dist import DistConfig
from plyx.specs.config.kernel import KernelConfig
from plyx.specs.config.model import ModelConfig, MoEConfig, RopeScaling
from plyx.specs.config.serve import ServeConfig
from plyx.specs.config.train import CardConfig, DataConfig, DraftConfig, OptimizerConfig, ScheduleConfig, TrainConfig

__all__ = [
    "FORMATS",
    "CardConfig",
    "ConfigBase",
    "DataConfig",
    "DraftConfig",
    "DistConfig",
    "KernelConfig",
    "MoEConfig",
    "ModelConfig",
    "OptimizerConfig",
    "RopeScaling",
    "ScheduleConfig",
    "ServeConfig",
    "TrainConfig",
    "dump_config",
    "load_config",
    "migration",
    "migrations_for",
]
