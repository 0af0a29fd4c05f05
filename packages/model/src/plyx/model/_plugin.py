"""The built-in plugin of plyx-model, registered under the `plyx` entry-point group."""

from __future__ import annotations

from typing import Any

from plyx.specs import hookimpl

plyx_contracts = {"hooks": "1.0", "checkpoint": "1.0"}


@hookimpl
def plyx_cli_commands() -> list[Any]:
    from plyx.model._cli import command

    return [command()]
