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

from typing import Any

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


def __getattr__(name: str) -> Any:
    """Load the public names on first use (PEP 562).

    Importing ``plyx.safety`` (and so its plugin entry point, ``plyx.safety._plugin``)
    imports nothing heavy: ``plyx --help`` and ``plyx plugins`` never load torch.
    The names live in ``plyx.safety._exports``.
    """
    if name in __all__:
        from plyx.safety import _exports

        value = getattr(_exports, name)
        globals()[name] = value  # later lookups are plain attribute reads
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
