"""Secrets and API keys: known token prefixes, private-key blocks, and
high-entropy values assigned to secret-looking names.

Prefixes follow the providers' published formats (the same ones GitHub secret
scanning and gitleaks match). A bare random string is not flagged on its own:
hashes, UUIDs and base64 data look random too; a value is flagged when a name
such as ``api_key``/``token``/``password`` is assigned it and its Shannon
entropy is high enough to be a real secret rather than a placeholder.
"""

from __future__ import annotations

import math
import re
from collections import Counter

from plyx.safety._span import SpanDetector

__all__ = ["SecretsDetector", "shannon_entropy", "KNOWN_PREFIXES"]

# (kind, pattern); each pattern matches the whole token
KNOWN_PREFIXES: list[tuple[str, str]] = [
    ("aws_access_key", r"(?:AKIA|ASIA|AGPA|AIDA|AROA|ANPA|ANVA|AIPA)[0-9A-Z]{16}"),
    ("github_token", r"gh[pousr]_[A-Za-z0-9]{36,255}"),
    ("github_pat", r"github_pat_[A-Za-z0-9_]{60,255}"),
    ("gitlab_token", r"glpat-[A-Za-z0-9_\-]{20}"),
    ("slack_token", r"xox[abposr]-[A-Za-z0-9\-]{10,72}"),
    ("stripe_key", r"(?:sk|rk|pk)_(?:live|test)_[A-Za-z0-9]{24,99}"),
    ("anthropic_key", r"sk-ant-[A-Za-z0-9_\-]{32,120}"),
    ("openai_key", r"sk-(?:proj-|svcacct-|admin-)?[A-Za-z0-9_\-]{32,200}"),
    ("google_api_key", r"AIza[0-9A-Za-z_\-]{35}"),
    ("huggingface_token", r"hf_[A-Za-z0-9]{34,40}"),
    ("npm_token", r"npm_[A-Za-z0-9]{36}"),
    ("pypi_token", r"pypi-AgEIcHlwaS5vcmc[A-Za-z0-9_\-]{50,}"),
    ("sendgrid_key", r"SG\.[A-Za-z0-9_\-]{22}\.[A-Za-z0-9_\-]{43}"),
    ("jwt", r"eyJ[A-Za-z0-9_\-]{8,}\.eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}"),
]

_TOKEN_EDGE_L = r"(?<![A-Za-z0-9_\-])"
_TOKEN_EDGE_R = r"(?![A-Za-z0-9_\-])"
_PRIVATE_KEY = re.compile(
    r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----.*?(?:-----END (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----|\Z)",
    re.S,
)
_NAME = (r"(?i)\b(?:[a-z0-9]+[_\-.])*(?:api[_\-]?key|apikey|secret(?:[_\-]?key)?|access[_\-]?key|access[_\-]?token"
         r"|auth[_\-]?token|token|passw(?:or)?d|pwd|client[_\-]?secret|private[_\-]?key|credentials?)\b"
         r"[\"']?[ \t]{0,8}(?::=|=>|[:=])[ \t]{0,8}[\"']?")
_ASSIGNED = re.compile(_NAME + r"([^\s\"'`,;]{12,})")
# a value still being written: everything after the "=" may become part of a finding
_ASSIGNING = re.compile(_NAME + r"([^\s\"'`,;]*)\Z")
_VALUE_RUN = re.compile(r"[^\s\"'`,;]*\Z")
_NAME_REACH = 96  # characters a name, its separator and quotes take before the value
_PLACEHOLDER = re.compile(r"(?i)(x{4,}|\*{4,}|your|example|placeholder|changeme|dummy|redacted|<|\$\{|\{\{|%\(|os\.environ|getenv)")


# stand-ins with a real prefix (AKIAXXXXXXXXXXXXXXXX, sk-live-****, ghp_000000...). AWS's documented
# AKIAIOSFODNN7EXAMPLE is kept a finding: it has a real key's shape and is pasted into real configs
_TOKEN_PLACEHOLDER = re.compile(r"(?i)x{6,}|\*{4,}|0{8,}|placeholder|your[_\-]?(?:key|token)")


def _placeholder_token(token: str) -> bool:
    """True for a prefixed token that is a documentation stand-in rather than a key."""
    body = re.sub(r"^[A-Za-z]{2,4}[_\-]|^(?:AKIA|ASIA|AGPA|AIDA|AROA|ANPA|ANVA|AIPA|AIza|eyJ)", "", token)
    return bool(_TOKEN_PLACEHOLDER.search(token)) or len(set(body)) < 6


def shannon_entropy(s: str) -> float:
    """Bits per character of ``s``'s character distribution (log2)."""
    if not s:
        return 0.0
    n = len(s)
    return -sum(c / n * math.log2(c / n) for c in Counter(s).values())


class SecretsDetector(SpanDetector):
    """API keys by known prefixes, private-key blocks, and assigned high-entropy values.

    Args:
        min_entropy: bits per character an assigned value needs (real 20+ char
            keys are above 3.5; ``password123`` is 3.1).
        kinds: restrict the known-prefix kinds (default: all of ``KNOWN_PREFIXES``).
    """

    name = "secrets"
    alphabet = r"[\w\-./+=:]"
    max_len = 256

    def __init__(self, min_entropy: float = 3.5, kinds: list[str] | None = None) -> None:
        super().__init__()
        from plyx.safety._types import DetectorOptionError

        known = dict(KNOWN_PREFIXES)
        if kinds is not None:
            bad = [k for k in kinds if k not in known]
            if bad:
                raise DetectorOptionError("kinds", "unknown secret kind", value=bad[0], fix=f"choose from {', '.join(known)}")
        chosen = [(k, p) for k, p in KNOWN_PREFIXES if kinds is None or k in kinds]
        self.min_entropy = float(min_entropy)
        self._prefixed = re.compile("|".join(f"(?P<{k}>{_TOKEN_EDGE_L}{p}{_TOKEN_EDGE_R})" for k, p in chosen))

    def _scan(self, text: str) -> list[tuple[str, int, int, float, str]]:
        hits = []
        for m in self._prefixed.finditer(text):
            if not _placeholder_token(m.group()):
                hits.append(("secret", m.start(), m.end(), 1.0, m.lastgroup or "prefix"))
        for m in _PRIVATE_KEY.finditer(text):
            hits.append(("secret", m.start(), m.end(), 1.0, "private_key"))
        for m in _ASSIGNED.finditer(text):
            value = m.group(1)
            classes = sum(bool(re.search(c, value)) for c in (r"[a-z]", r"[A-Z]", r"\d", r"[^A-Za-z0-9]"))
            if classes >= 2 and shannon_entropy(value) >= self.min_entropy and not _PLACEHOLDER.search(value):
                hits.append(("secret", m.start(1), m.end(1), 0.8, "assigned high-entropy value"))
        return hits

    def pending(self, text: str) -> int:
        # an unterminated private-key block is held until its END line arrives
        begin = text.rfind("-----BEGIN ")
        if begin >= 0 and "-----END " not in text[begin:]:
            return begin
        hold = super().pending(text)
        norm = self._normalize(text)
        # the value being written may be longer than max_len: start from its name,
        # which sits right before the trailing run of value characters
        run = _VALUE_RUN.search(norm.text)
        start = max(0, (run.start() if run else len(norm.text)) - _NAME_REACH)
        m = _ASSIGNING.search(norm.text, start)
        return min(hold, norm.offset(m.start(1))) if m else hold
