"""The built-in plugin of plyx-serve, registered under the `plyx` entry-point group.

Contributes every built-in logits processor and sampler through ``plyx_samplers``, the tool-call parsers
through ``plyx_tool_parsers`` and the KV connector of disaggregated serving through ``plyx_kv_connectors``;
each is found by name exactly as a third party's is.
"""

from __future__ import annotations

from typing import Any

from plyx.specs import Component, hookimpl

plyx_contracts = {"hooks": "1.0"}


@hookimpl
def plyx_samplers() -> list[Any]:
    from plyx.serve._pipeline import BUILTIN_COMPONENTS

    return [Component(name, factory, description) for name, (factory, description) in BUILTIN_COMPONENTS.items()]


@hookimpl
def plyx_tool_parsers() -> list[Any]:
    from plyx.serve.server._tool_parsers import BUILTIN_PARSERS

    return [Component(name, cls, (cls.__doc__ or "").split("\n")[0]) for name, cls in BUILTIN_PARSERS.items()]


@hookimpl
def plyx_kv_connectors() -> list[Any]:
    from plyx.serve.disagg._connector import BUILTIN_CONNECTORS

    return [Component(name, cls, (cls.__doc__ or "").split("\n")[0]) for name, cls in BUILTIN_CONNECTORS.items()]


@hookimpl
def plyx_cli_commands() -> list[Any]:
    # importing the command does not import fastapi/uvicorn: they load when `plyx serve` runs
    from plyx.serve.server import SERVE_COMMAND

    return [SERVE_COMMAND]
