"""The public names of ``plyx.governance``, imported on first use by its ``__getattr__`` (keeps the package light)."""
# re-exports: plyx.governance.__all__ names them and its __getattr__ serves them
# ruff: noqa: F401

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
