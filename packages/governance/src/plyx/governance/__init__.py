"""Governance artifacts for plyx: SPDX SBOMs, Ed25519/DSSE signatures, reproducibility receipts, lineage, model cards and the verify gate (no torch).

Installing plyx-governance attaches it to training and export through hooks
(see ``plyx.governance._plugin``); everything is also callable from Python
and from ``plyx governance ...`` / ``python -m plyx.governance ...``.
"""

from typing import Any

__all__ = [
    "GovernanceError",
    "KeyPermissionError",
    "Problem",
    "Report",
    "build_card",
    "build_cyclonedx",
    "build_spdx",
    "canonical_json",
    "content_id",
    "generate_keypair",
    "key_id",
    "lineage_dot",
    "load_private_key",
    "load_public_key",
    "load_receipt",
    "make_receipt",
    "make_statement",
    "pae",
    "render_card",
    "sign_envelope",
    "sign_files",
    "validate_spdx",
    "verify_envelope",
    "verify_receipt",
    "verify_release",
    "verify_signature",
    "write_card",
    "write_checkpoint_records",
    "write_lineage",
    "write_receipt",
    "write_release",
    "write_sbom",
]


def __getattr__(name: str) -> Any:
    """Load the public names on first use (PEP 562).

    Importing ``plyx.governance`` (and so its plugin entry point, ``plyx.governance._plugin``)
    imports nothing heavy: ``plyx --help`` and ``plyx plugins`` never load torch.
    The names live in ``plyx.governance._exports``.
    """
    if name in __all__:
        from plyx.governance import _exports

        value = getattr(_exports, name)
        globals()[name] = value  # later lookups are plain attribute reads
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
