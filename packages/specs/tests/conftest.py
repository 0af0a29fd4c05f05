"""Fixtures: fake installed distributions, so discovery runs through real entry points."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from plyx.specs import plugins


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Path]]:
    """``site(dist, version, {ep_name: module_source})`` installs a fake distribution.

    Each entry point ``ep_name`` points at a module ``<dist>_<ep_name>`` whose
    source is given; the distribution's ``.dist-info`` carries the entry points,
    so importlib.metadata finds them exactly as it finds pip-installed ones.
    """
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delenv("PLYX_PLUGINS", raising=False)
    monkeypatch.delenv("PLYX_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.delenv("PLYX_STRICT_PLUGINS", raising=False)
    modules: list[str] = []

    def install(dist: str, version: str, entry_points: dict[str, str]) -> Path:
        info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        lines = ["[plyx]"]
        for ep_name, source in entry_points.items():
            module = f"{dist.replace('-', '_')}_{ep_name}"
            (root / f"{module}.py").write_text(textwrap.dedent(source))
            lines.append(f"{ep_name} = {module}")
            modules.append(module)
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        plugins.reset_plugins()
        return root

    yield install
    for module in modules:
        sys.modules.pop(module, None)
    plugins.reset_plugins()


@pytest.fixture
def only(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """Restrict loading to the named plugins (other planes may be installed in dev venvs)."""

    def restrict(*names: str) -> None:
        monkeypatch.setenv("PLYX_PLUGINS", ",".join(names))
        plugins.reset_plugins()

    return restrict
