"""The built-in detectors as ``plyx_guardrails`` components, and building a detector by name."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping
from typing import Any

from plyx.safety._classifier import ClassifierDetector
from plyx.safety._injection import PromptInjectionDetector
from plyx.safety._limits import LengthDetector, RateLimitDetector
from plyx.safety._lists import DenyListDetector
from plyx.safety._pii import (
    CreditCardDetector,
    EmailDetector,
    IbanDetector,
    IpAddressDetector,
    NationalIdDetector,
    PhoneDetector,
    PiiDetector,
)
from plyx.safety._regex import RegexDetector
from plyx.safety._secrets import SecretsDetector
from plyx.safety._types import DetectorOptionError
from plyx.specs import Component
from plyx.specs.plugins import components

__all__ = ["BUILTIN_DETECTORS", "available_detectors", "build_detector", "UnknownDetectorError"]

BUILTIN_DETECTORS = [
    Component("email", EmailDetector, "email addresses, incl. [at]/[dot] obfuscations"),
    Component("phone", PhoneDetector, "phone numbers (E.164, North American, after a phone keyword)"),
    Component("credit_card", CreditCardDetector, "payment card numbers with issuer prefix and Luhn check"),
    Component("iban", IbanDetector, "IBANs with registry length and MOD 97-10 check"),
    Component("national_id", NationalIdDetector, "US SSN, UK NINO, Spanish DNI/NIE, Indian Aadhaar"),
    Component("ip_address", IpAddressDetector, "IPv4 and IPv6 addresses"),
    Component("secrets", SecretsDetector, "API keys by known prefix, private keys, assigned high-entropy values"),
    Component("pii", PiiDetector, "all PII entities above (or `entities`) in one detector"),
    Component("deny_list", DenyListDetector, "deny/allow terms with Unicode, homoglyph and leetspeak folding"),
    Component("regex", RegexDetector, "user regular expressions"),
    Component("prompt_injection", PromptInjectionDetector, "injection/jailbreak heuristics with payload decoding"),
    Component("length", LengthDetector, "character, word and line limits"),
    Component("rate_limit", RateLimitDetector, "requests per window per client (input rails)"),
    Component("classifier", ClassifierDetector, "any text classifier model (callable or import string)"),
]


class UnknownDetectorError(LookupError):
    """No installed plugin provides the detector."""


def available_detectors() -> dict[str, Component]:
    """Every detector the installed plugins provide (the built-ins come from plyx-safety's own plugin)."""
    found = components("plyx_guardrails")
    if not found:  # plugin autoload disabled and nothing registered by hand: the built-ins still work
        found = {c.name: c for c in BUILTIN_DETECTORS}
    return found


def _signature(factory: Any) -> tuple[list[str], bool] | None:
    """(keyword parameters, takes **kwargs) of a factory, or None when it cannot be inspected."""
    try:
        params = list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):
        return None
    names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "clock"]
    return names, any(p.kind is p.VAR_KEYWORD for p in params)


def build_detector(name: str, options: Mapping[str, Any] | None = None) -> Any:
    """Build the detector ``name`` with ``options``.

    Raises:
        UnknownDetectorError: no plugin provides ``name`` (with close matches).
        DetectorOptionError: an option is unknown or invalid.
    """
    found = available_detectors()
    if name not in found:
        close = difflib.get_close_matches(name, list(found), n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"known detectors: {', '.join(sorted(found))}"
        raise UnknownDetectorError(f"detector {name!r} not found. It is either misspelled or not installed; {hint}")
    factory = found[name].factory
    opts = dict(options or {})
    signature = _signature(factory)
    if signature is not None and not signature[1]:
        accepted = signature[0]
        for key in opts:
            if key not in accepted:
                close = difflib.get_close_matches(key, accepted, n=1)
                fix = f"did you mean `{close[0]}`?" if close else f"{name} accepts: {', '.join(accepted) or 'no options'}"
                raise DetectorOptionError(key, f"unknown option of detector {name!r}", fix=fix)
    try:
        detector = factory(**opts)
    except DetectorOptionError:
        raise
    except TypeError as exc:
        raise DetectorOptionError("options", f"detector {name!r} rejected its options: {exc}") from None
    for attr in ("detect", "scope"):
        if not hasattr(detector, attr):
            raise DetectorOptionError("detector", f"the factory of {name!r} ({found[name].source or 'unknown plugin'}) "
                                      f"returned {type(detector).__name__} without `{attr}`")
    return detector
