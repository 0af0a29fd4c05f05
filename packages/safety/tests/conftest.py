"""Fixtures: load only plyx-safety's own plugin (dev venvs carry every plane) and isolate global state."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from plyx.specs import plugins


@pytest.fixture(autouse=True)
def _only_safety(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("PLYX_PLUGINS", "safety")
    monkeypatch.delenv("PLYX_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.delenv("PLYX_SAFETY_POLICY", raising=False)
    monkeypatch.delenv("PLYX_SAFETY_AUDIT_LOG", raising=False)
    plugins.reset_plugins()
    yield
    from plyx.safety import deactivate

    deactivate()
    plugins.reset_plugins()
