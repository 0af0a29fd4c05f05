"""The public names of ``plyx.safety``, imported on first use by its ``__getattr__`` (keeps the package light)."""
# re-exports: plyx.safety.__all__ names them and its __getattr__ serves them
# ruff: noqa: F401

from plyx.safety._audit import AuditLog, fingerprint
from plyx.safety._detectors import available_detectors, build_detector
from plyx.safety._engine import Decision, RuleHit, refusal
from plyx.safety._evaluate import evaluate
from plyx.safety._guard import Guard
from plyx.safety._normalize import normalize
from plyx.safety._policy import Policy, Rule, load_policy
from plyx.safety._probes import HAZARDS, Attempt, Refusal, is_refusal
from plyx.safety._redteam import RedteamReport, RedteamResult, available_probes, run_redteam
from plyx.safety._scan import ScanSummary, scan_corpus
from plyx.safety._serving import activate, active_guard, deactivate
from plyx.safety._stream import StreamFilter
from plyx.safety._targets import GuardedTarget, HttpTarget, TargetError, resolve_target
from plyx.safety._types import Detector, DetectorOptionError, Finding
