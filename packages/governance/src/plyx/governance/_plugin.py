"""The built-in plugin of plyx-governance, registered under the `plyx` entry-point group.

Installing plyx-governance is all a user does: plyx-train's checkpoint hook
then writes receipts and lineage, plyx-export's export hook writes the signed
release records, and ``plyx governance`` appears.
"""

from __future__ import annotations

from typing import Any

from plyx.specs import CliCommand, hookimpl
from plyx.specs.components import deferred

plyx_contracts = {"hooks": "1.0"}


@hookimpl
def plyx_cli_commands() -> list[Any]:
    # the command's module imports cryptography: it loads when `plyx governance` runs, not for `plyx --help`
    return [CliCommand("governance", "SBOMs, signatures, receipts, lineage, model cards and the release gate",
                       deferred("plyx.governance._cli:configure"), deferred("plyx.governance._cli:run"))]


@hookimpl
def plyx_on_checkpoint_saved(path: str, step: int, metadata: dict[str, Any]) -> None:
    """Write RECEIPT.json and LINEAGE.dot next to the checkpoint's files."""
    from plyx.governance._release import write_checkpoint_records

    write_checkpoint_records(path, step, metadata or {})


@hookimpl
def plyx_on_export_written(path: str, format: str, metadata: dict[str, Any]) -> None:
    """Write the SBOMs, receipt, lineage, model card, checksums and signature into the export directory."""
    from plyx.governance._release import write_release
    from plyx.specs.payloads import payload_dict

    meta = payload_dict(metadata)  # a plyx.specs.payloads.ExportPayload or a dict
    artifacts = meta.get("artifacts")
    write_release(path, name=meta.get("name"), format=format, artifacts=list(artifacts) if artifacts else None,
                  source=meta.get("source"), metadata=meta)


@hookimpl
def plyx_on_response(request: dict[str, Any], response: dict[str, Any], context: dict[str, Any]) -> None:
    """Opt-in (``PLYX_SERVE_RECEIPTS=DIR``): append a receipt of the response's decoding settings."""
    from plyx.governance._serve_receipts import record_response

    record_response(request, response, context)
