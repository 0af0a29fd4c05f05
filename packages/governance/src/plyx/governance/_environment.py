"""What the current process runs on: installed distributions, system, accelerator, git state.

Everything here is read without importing torch (this plane never does):
the accelerator comes from the caller's metadata when given, else from
``nvidia-smi`` when it is on PATH.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["Distribution", "installed_distributions", "normalize_name", "system_info", "python_info",
           "accelerator_info", "git_info"]

_NORMALIZE = re.compile(r"[-_.]+")
_REQ_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def normalize_name(name: str) -> str:
    """PEP 503 normalized distribution name (``Foo_Bar`` -> ``foo-bar``)."""
    return _NORMALIZE.sub("-", name).lower()


@dataclass(frozen=True)
class Distribution:
    """One installed distribution as the SBOM and receipts see it."""

    name: str
    version: str
    license_expression: str = ""
    """``License-Expression`` (PEP 639) when declared."""
    license_text: str = ""
    """The free-form ``License`` field."""
    license_classifiers: tuple[str, ...] = ()
    summary: str = ""
    homepage: str = ""
    requires: tuple[str, ...] = field(default=())
    """Normalized names of unconditional or environment-marker-only requirements (extras left out)."""
    direct_url: str = ""
    """The PEP 610 ``direct_url.json`` of a distribution installed from a URL, a VCS or a local
    directory (canonical JSON), "" for one installed from an index."""

    def source(self) -> dict[str, Any] | None:
        """The parsed ``direct_url.json`` (None when installed from an index, or unreadable)."""
        if not self.direct_url:
            return None
        try:
            info = json.loads(self.direct_url)
        except ValueError:
            return None
        return info if isinstance(info, dict) and isinstance(info.get("url"), str) else None


def _requires(dist: Any) -> tuple[str, ...]:
    names = []
    for req in dist.requires or ():
        # requirements behind an extra are optional; others may still carry a
        # python_version marker, and count only when the target is installed
        if "extra" in req.partition(";")[2]:
            continue
        m = _REQ_NAME.match(req)
        if m:
            names.append(normalize_name(m.group(1)))
    return tuple(sorted(set(names)))


def _direct_url(dist: Any) -> str:
    """PEP 610 ``direct_url.json`` as canonical JSON ("" when absent or not JSON)."""
    try:
        text = dist.read_text("direct_url.json")
    except OSError:
        return ""
    if not text:
        return ""
    try:
        return json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
    except ValueError:
        return ""


def installed_distributions() -> list[Distribution]:
    """Every distribution importable from ``sys.path``, first one per name wins, sorted by name."""
    seen: dict[str, Distribution] = {}
    for dist in metadata.distributions():
        meta = dist.metadata
        name = meta.get("Name") if meta is not None else None
        if not name:
            continue  # a broken .dist-info without a name: nothing to record
        key = normalize_name(name)
        if key in seen:
            continue
        homepage = meta.get("Home-page") or ""
        for url in meta.get_all("Project-URL") or ():
            label, _, link = url.partition(",")
            if not homepage and label.strip().lower() in ("homepage", "home", "source", "repository"):
                homepage = link.strip()
        seen[key] = Distribution(
            name=name,
            version=dist.version or "",
            license_expression=(meta.get("License-Expression") or "").strip(),
            license_text=(meta.get("License") or "").strip(),
            license_classifiers=tuple(c for c in (meta.get_all("Classifier") or ()) if c.startswith("License ::")),
            summary=(meta.get("Summary") or "").strip(),
            homepage=homepage,
            requires=_requires(dist),
            direct_url=_direct_url(dist),
        )
    return [seen[k] for k in sorted(seen)]


def system_info() -> dict[str, Any]:
    """OS, kernel, machine and CPU count (no host name: receipts get shared)."""
    return {
        "os": platform.system(),
        "release": platform.release(),
        "machine": platform.machine(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
    }


def python_info() -> dict[str, Any]:
    """Interpreter version and implementation."""
    return {
        "version": platform.python_version(),
        "implementation": platform.python_implementation(),
        "compiler": platform.python_compiler(),
        "executable": Path(sys.executable).name,
    }


def accelerator_info(timeout_s: float = 5.0) -> dict[str, Any]:
    """GPUs from ``nvidia-smi`` when present, else ``{"kind": "none detected"}``.

    Probed once per process: devices do not change during a run, and the
    checkpoint hook runs at every save.
    """
    return copy.deepcopy(_accelerator_probe(timeout_s))


@functools.cache
def _accelerator_probe(timeout_s: float) -> dict[str, Any]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {"kind": "none detected", "probe": "nvidia-smi not on PATH"}
    try:
        out = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=timeout_s, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return {"kind": "none detected", "probe": f"nvidia-smi failed: {type(exc).__name__}"}
    devices = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3:
            devices.append({"name": parts[0], "driver": parts[1], "memory": parts[2]})
    return {"kind": "cuda" if devices else "none detected", "devices": devices, "probe": "nvidia-smi"}


def git_info(where: str | os.PathLike[str] = ".", timeout_s: float = 10.0) -> dict[str, Any] | None:
    """Commit and dirty state of the git work tree holding ``where``; None outside one or without git."""
    git = shutil.which("git")
    if git is None:
        return None
    cwd = Path(where)
    cwd = cwd if cwd.is_dir() else cwd.parent

    def run(*args: str) -> str | None:
        try:
            done = subprocess.run([git, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout if done.returncode == 0 else None

    commit = run("rev-parse", "HEAD")
    if commit is None:
        return None
    status = run("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit.strip(), "dirty": bool(status and status.strip()) if status is not None else None}
