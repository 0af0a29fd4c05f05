"""Exporters as plugins, atomic export directories and the ``plyx_on_export_written`` hook.

These use small in-process exporters (no ONNX), registered through
``plyx.specs.plugins.register_plugin`` and unregistered after each test.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from plyx.export import ExportError, ExportHookError, available_formats, export, exporter
from plyx.specs import Component, hookimpl, plugins


class _Exporters:
    """Third-party style exporters: ``probe`` writes one file; ``broken`` writes one, then fails."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def probe(self, model: Any, out_dir: Path, **options: Any) -> list[Path]:
        self.seen.append({"out_dir": Path(out_dir), "options": options})
        (Path(out_dir) / "weights.bin").write_bytes(b"\x00" * 8)
        return [Path(out_dir) / "weights.bin"]

    def broken(self, model: Any, out_dir: Path, **options: Any) -> list[Path]:
        self.seen.append({"out_dir": Path(out_dir), "options": options})
        (Path(out_dir) / "half-written.bin").write_bytes(b"\x00")
        raise RuntimeError("disk full (simulated)")

    @hookimpl
    def plyx_exporters(self) -> list[Any]:
        return [Component("probe", self.probe, "test exporter"), Component("broken", self.broken, "fails midway")]


@pytest.fixture
def exporters(only_export_plugins: None) -> Iterator[_Exporters]:
    plugin = _Exporters()
    plugins.register_plugin(plugin, "export-test-exporters")
    try:
        yield plugin
    finally:
        plugins.unregister_plugin("export-test-exporters")


def _leftovers(parent: Path, name: str) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.")]


def test_exporters_are_found_by_name_across_plugins(exporters: _Exporters) -> None:
    formats = available_formats()
    assert {"onnx", "probe", "broken"} <= set(formats)
    assert formats["onnx"].source.startswith("plyx-export")
    assert exporter("probe").factory == exporters.probe


def test_unknown_format_lists_the_available_ones(only_export_plugins: None) -> None:
    with pytest.raises(ExportError) as info:
        exporter("onxx")
    assert info.value.field == "format"
    assert "'onxx' not found" in str(info.value) and "available formats: gguf, hf, onnx" in str(info.value)


def test_export_is_written_in_a_temporary_sibling_then_renamed(exporters: _Exporters, tmp_path: Path,
                                                               hook_recorder) -> None:
    dest = tmp_path / "release"
    result = export(object(), dest, format="probe", name="r1", flavour="x")
    (seen,) = exporters.seen
    assert seen["out_dir"] != dest and seen["out_dir"].parent == dest.parent  # same filesystem: atomic rename
    assert seen["out_dir"].name.startswith(".release.tmp-") and not seen["out_dir"].exists()
    assert seen["options"] == {"flavour": "x"}
    assert list(result) == [dest / "weights.bin"] and (dest / "weights.bin").read_bytes() == b"\x00" * 8
    assert _leftovers(tmp_path, "release") == []
    (call,) = hook_recorder.calls
    assert call["path"] == str(dest) and call["format"] == "probe"
    assert call["metadata"]["artifacts"] == [str(dest / "weights.bin")] and call["metadata"]["name"] == "r1"
    assert "source" not in call["metadata"]


def test_a_failed_export_leaves_nothing_behind(exporters: _Exporters, tmp_path: Path, hook_recorder) -> None:
    with pytest.raises(RuntimeError, match="disk full"):
        export(object(), tmp_path / "release", format="broken")
    assert list(tmp_path.iterdir()) == [] and hook_recorder.calls == []


def test_a_failed_forced_export_keeps_the_previous_one(exporters: _Exporters, tmp_path: Path) -> None:
    dest = tmp_path / "release"
    dest.mkdir()
    (dest / "model.onnx").write_bytes(b"previous")
    with pytest.raises(RuntimeError, match="disk full"):
        export(object(), dest, format="broken", force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["release"]
    assert [p.name for p in dest.iterdir()] == ["model.onnx"] and (dest / "model.onnx").read_bytes() == b"previous"


def test_forced_export_replaces_a_non_empty_directory(exporters: _Exporters, tmp_path: Path) -> None:
    dest = tmp_path / "release"
    dest.mkdir()
    (dest / "old.txt").write_text("old")
    with pytest.raises(ExportError, match="exists and is not empty") as info:
        export(object(), dest, format="probe")
    assert info.value.field == "out_dir" and exporters.seen == []  # refused before the exporter ran
    export(object(), dest, format="probe", force=True)
    assert [p.name for p in dest.iterdir()] == ["weights.bin"] and _leftovers(tmp_path, "release") == []


def test_an_empty_existing_directory_is_used_and_a_file_is_refused(exporters: _Exporters, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    export(object(), tmp_path / "empty", format="probe")
    assert [p.name for p in (tmp_path / "empty").iterdir()] == ["weights.bin"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(ExportError, match="is a file"):
        export(object(), tmp_path / "file", format="probe")


def test_a_failing_hook_is_reported_and_the_export_kept(exporters: _Exporters, tmp_path: Path) -> None:

    failing = _FailingHook()
    plugins.register_plugin(failing, "export-test-failing-hook")
    try:
        with pytest.raises(ExportHookError) as info:
            export(object(), tmp_path / "release", format="probe")
    finally:
        plugins.unregister_plugin("export-test-failing-hook")
    assert "RuntimeError: governance unavailable" in str(info.value)
    assert info.value.result.path == tmp_path / "release" and (tmp_path / "release" / "weights.bin").exists()


def test_missing_source_checkpoint_is_named(exporters: _Exporters, tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="does not exist") as info:
        export(object(), tmp_path / "release", format="probe", source=tmp_path / "nope")
    assert info.value.field == "source" and list(tmp_path.iterdir()) == []


class _FailingHook:
    @hookimpl
    def plyx_on_export_written(self, path: str, format: str, metadata: dict[str, Any]) -> None:
        raise RuntimeError("governance unavailable")
