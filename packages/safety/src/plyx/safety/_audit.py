"""The audit log: one JSON object per line for every guardrail decision, never the raw text.

A record names the rule, detector, action, labels and how many spans matched,
plus a keyed fingerprint of each matched span (HMAC-SHA256, truncated) so the
same leaked value can be correlated across records without being stored. The
key comes from ``PLYX_SAFETY_AUDIT_KEY`` (set it to correlate across processes)
or is random per process: low-entropy PII such as a phone number could be
brute-forced back from an unkeyed hash.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["AuditLog", "fingerprint"]

_PROCESS_KEY = os.urandom(32)


def _key() -> bytes:
    env = os.environ.get("PLYX_SAFETY_AUDIT_KEY", "")
    return env.encode() if env else _PROCESS_KEY


def fingerprint(value: str) -> str:
    """A keyed, truncated digest of ``value`` (16 hex characters)."""
    return hmac.new(_key(), value.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()[:16]


class AuditLog:
    """Appends audit records to a JSONL file (thread-safe) and keeps the last ``keep`` in memory.

    Args:
        path: the JSONL file; None keeps records in memory only.
        keep: how many recent records ``recent`` holds.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, keep: int = 1000) -> None:
        self.path = Path(path) if path else None
        self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=keep)
        self._lock = threading.Lock()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> dict[str, Any]:
        """Append ``record`` (a ``ts`` in Unix seconds is added) and return it."""
        record = {"ts": round(time.time(), 3), **record}
        line = json.dumps(record, ensure_ascii=False, sort_keys=False, default=str)
        with self._lock:
            self.recent.append(record)
            if self.path is not None:
                # one write per line in append mode: lines from threads never interleave
                with self.path.open("a", encoding="utf-8") as fh:
                    fh.write(line + "\n")
        return record
