"""plyx-safety: policy-as-code guardrails for plyx serving and data, and a red-team suite (no torch).

Install it and name a policy (``ServeConfig.guardrail_policy``, ``PLYX_SAFETY_POLICY``
or ``activate()``): input rails run before any compute, output rails filter the
stream, every decision goes to a JSONL audit log without the raw text.

Example:
    >>> from plyx.safety import Guard
    >>> guard = Guard("builtin:default")
    >>> guard.check_output("mail me: jane@example.com").text
    'mail me: [EMAIL]'
"""

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

__all__ = [
    "HAZARDS",
    "Attempt",
    "AuditLog",
    "Decision",
    "Detector",
    "DetectorOptionError",
    "Finding",
    "Guard",
    "GuardedTarget",
    "HttpTarget",
    "Policy",
    "RedteamReport",
    "RedteamResult",
    "Refusal",
    "Rule",
    "RuleHit",
    "ScanSummary",
    "StreamFilter",
    "TargetError",
    "activate",
    "active_guard",
    "available_detectors",
    "available_probes",
    "build_detector",
    "deactivate",
    "evaluate",
    "fingerprint",
    "is_refusal",
    "load_policy",
    "normalize",
    "refusal",
    "resolve_target",
    "run_redteam",
    "scan_corpus",
]
