"""Errors of plyx-governance: each names the artifact or field, the value, the expected form and the fix."""

from __future__ import annotations

from typing import Any

from plyx.specs.errors import PlyxError, describe

__all__ = ["GovernanceError", "KeyPermissionError"]


class GovernanceError(PlyxError, ValueError):
    """An input to a governance command is missing, malformed or inconsistent.

    Attributes:
        what: the argument, field (``$.inputs[2]``) or file the problem is about.
        problem: what is wrong with it.
        value: the offending value (None when missing).
        fix: how to make it right.
    """

    def __init__(self, what: str, problem: str, *, value: Any = None, fix: str = "") -> None:
        self.what = what
        self.problem = problem
        self.value = value
        self.fix = fix
        super().__init__(describe(what, problem, value=value, fix=fix))


class KeyPermissionError(PlyxError, PermissionError):
    """A private key file is readable or writable by someone other than its owner.

    Attributes:
        path: the key file.
        mode: its permission bits (``0o644``).
    """

    def __init__(self, path: str, mode: int) -> None:
        self.path = path
        self.mode = mode
        super().__init__(
            f"private key {path} has permissions {mode:04o}; a signing key must be readable by its owner "
            f"only (0600): run `chmod 600 {path}`, or make a new one with `plyx governance keygen`"
        )
