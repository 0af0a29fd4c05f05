"""Timestamps for governance files, pinned by SOURCE_DATE_EPOCH when set (reproducible-builds.org)."""

from __future__ import annotations

import os
from datetime import datetime, timezone

__all__ = ["utc_now"]


def utc_now() -> str:
    """ISO 8601 UTC time to the second, or SOURCE_DATE_EPOCH's time so reruns give byte-identical files."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    when = datetime.fromtimestamp(int(epoch), timezone.utc) if epoch else datetime.now(timezone.utc)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")
