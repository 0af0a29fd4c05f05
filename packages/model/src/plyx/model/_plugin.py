"""The built-in plugin of plyx-model, registered under the `plyx` entry-point group."""

from __future__ import annotations

from typing import Any

from plyx.specs import Component, hookimpl

plyx_contracts = {"hooks": "1.0", "checkpoint": "1.0"}


@hookimpl
def plyx_cli_commands() -> list[Any]:
    from plyx.model._cli import command

    return [command()]


@hookimpl
def plyx_adapter_variants() -> list[Any]:
    from plyx.model.adapters._variants import DoraVariant, LoraVariant, RsLoraVariant

    return [
        Component("lora", LoraVariant, "LoRA: W x + (alpha / r) B A x"),
        Component("rslora", RsLoraVariant, "rank-stabilised LoRA: scaling alpha / sqrt(r)"),
        Component("dora", DoraVariant, "DoRA: learned magnitude times the normalised W + s B A (PEFT's form)"),
    ]
