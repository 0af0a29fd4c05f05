"""The built-in plugin of plyx-safety, registered under the `plyx` entry-point group.

It contributes the built-in detectors and probes, the ``plyx safety`` command,
and the serving and data hooks (which do nothing until a policy is named: see
``plyx.safety._serving``).
"""

from __future__ import annotations

from typing import Any

from plyx.specs import hookimpl

plyx_contracts = {"hooks": "1.0"}


@hookimpl
def plyx_guardrails() -> list[Any]:
    from plyx.safety._detectors import BUILTIN_DETECTORS

    return list(BUILTIN_DETECTORS)


@hookimpl
def plyx_redteam_probes() -> list[Any]:
    from plyx.safety._redteam import BUILTIN_PROBE_COMPONENTS

    return list(BUILTIN_PROBE_COMPONENTS)


@hookimpl
def plyx_cli_commands() -> list[Any]:
    from plyx.safety._cli import COMMAND

    return [COMMAND]


@hookimpl
def plyx_on_request_received(request: dict[str, Any], context: dict[str, Any]) -> dict[str, Any] | None:
    from plyx.safety import _serving

    return _serving.on_request_received(request, context)


@hookimpl
def plyx_output_filters(request: dict[str, Any], context: dict[str, Any]) -> list[Any]:
    from plyx.safety import _serving

    return _serving.output_filters(request, context)


@hookimpl
def plyx_on_response(request: dict[str, Any], response: dict[str, Any], context: dict[str, Any]) -> None:
    from plyx.safety import _serving

    _serving.on_response(request, response, context)


@hookimpl
def plyx_document_filters(context: dict[str, Any]) -> list[Any]:
    from plyx.safety import _serving

    return _serving.document_filters(context)
