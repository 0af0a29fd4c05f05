"""Governance artifacts for plyx: SPDX SBOMs, Ed25519/DSSE signatures, reproducibility receipts, lineage, model cards and the verify gate (no torch).

Installing plyx-governance attaches it to training and export through hooks
(see ``plyx.governance._plugin``); everything is also callable from Python
and from ``plyx governance ...`` / ``python -m plyx.governance ...``.
"""

from plyx.governance._canonical import canonical_json, content_id
from plyx.governance._card import build_card, render_card, write_card
from plyx.governance._dsse import make_statement, pae, sign_envelope, verify_envelope
from plyx.governance._errors import GovernanceError, KeyPermissionError
from plyx.governance._keys import generate_keypair, key_id, load_private_key, load_public_key
from plyx.governance._lineage import lineage_dot, write_lineage
from plyx.governance._receipt import load_receipt, make_receipt, verify_receipt, write_receipt
from plyx.governance._release import verify_release, write_checkpoint_records, write_release
from plyx.governance._report import Problem, Report
from plyx.governance._sbom import build_cyclonedx, build_spdx, validate_spdx, write_sbom
from plyx.governance._sign import sign_files, verify_signature

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
