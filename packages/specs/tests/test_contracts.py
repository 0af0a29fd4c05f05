"""Frozen contracts: additive changes pass, breaking ones are caught."""

from __future__ import annotations

import json
from typing import Any, Protocol

import pytest
from plyx.specs import contracts


@pytest.fixture
def snapshots(tmp_path):
    contracts.write_snapshots(tmp_path)
    return tmp_path


def _swap(monkeypatch, contract: str, name: str, obj: Any) -> None:
    real = contracts._objects

    def patched():
        objs = real()
        if obj is None:
            objs[contract].pop(name)
        else:
            objs[contract][name] = obj
        return objs

    monkeypatch.setattr(contracts, "_objects", patched)


def test_fresh_snapshot_checks_clean(snapshots):
    report = contracts.check_snapshots(snapshots)
    assert report.ok, report.lines
    assert all("unchanged" in line for line in report.lines)


def test_removing_a_protocol_method_is_caught(snapshots, monkeypatch):
    from plyx.specs.kvcache import KVCache

    members = {k: v for k, v in vars(KVCache).items() if not k.startswith("_") and k != "fork"}
    KVCacheWithoutFork = type("KVCache", (Protocol,), members)
    _swap(monkeypatch, "kvcache", "KVCache", KVCacheWithoutFork)
    report = contracts.check_snapshots(snapshots)
    assert not report.ok
    assert any("KVCache.fork was removed" in line for line in report.lines)
    assert any("bump the major of the kvcache contract" in line for line in report.lines)


def test_changing_a_parameter_is_caught(snapshots, monkeypatch):
    def plyx_on_checkpoint_saved(path: str, step: str, metadata: dict) -> None:  # step: int -> str
        """changed"""

    plyx_on_checkpoint_saved.plyx_spec = {"firstresult": False, "historic": False}  # type: ignore[attr-defined]
    _swap(monkeypatch, "hooks", "plyx_on_checkpoint_saved", plyx_on_checkpoint_saved)
    report = contracts.check_snapshots(snapshots)
    assert not report.ok
    assert any("parameter `step` type changed" in line for line in report.lines)


def test_removing_a_hook_is_caught(snapshots, monkeypatch):
    _swap(monkeypatch, "hooks", "plyx_samplers", None)
    report = contracts.check_snapshots(snapshots)
    assert any("plyx_samplers was removed" in line for line in report.lines) and not report.ok


def test_new_required_struct_field_breaks_new_optional_one_is_additive():
    old = {"S": {"kind": "struct", "fields": {"a": {"type": "int", "default": "1"}}}}
    required = {"S": {"kind": "struct", "fields": {**old["S"]["fields"], "b": {"type": "int", "default": "<required>"}}}}
    optional = {"S": {"kind": "struct", "fields": {**old["S"]["fields"], "b": {"type": "int", "default": "0"}}}}
    assert contracts.compare("x", old, required)[0]
    breaks, adds = contracts.compare("x", old, optional)
    assert not breaks and adds


def test_config_field_change_with_schema_bump_is_a_migration_not_a_break():
    old = {"M": {"kind": "struct", "schema": "m", "schema_version": 1, "fields": {"n_embd": {"type": "int", "default": "1"}}}}
    new = {"M": {"kind": "struct", "schema": "m", "schema_version": 2, "fields": {"d_model": {"type": "int", "default": "1"}}}}
    breaks, adds = contracts.compare("config", old, new)
    assert not breaks and any("migrated" in a for a in adds)
    same_version = {"M": {**new["M"], "schema_version": 1}}
    assert contracts.compare("config", old, same_version)[0]


def test_additive_change_passes_and_updates_the_snapshot(snapshots, monkeypatch):
    def plyx_brand_new_hook(x: int) -> None:
        """new"""

    plyx_brand_new_hook.plyx_spec = {"firstresult": False, "historic": False}  # type: ignore[attr-defined]
    _swap(monkeypatch, "hooks", "plyx_brand_new_hook", plyx_brand_new_hook)
    report = contracts.check_snapshots(snapshots)
    assert report.ok
    assert "plyx_brand_new_hook" in json.loads((snapshots / "hooks" / "v1.json").read_text())["surface"]


def test_new_optional_parameter_is_additive_new_required_is_not():
    old = {"f": {"kind": "function", "params": [{"name": "a", "kind": "POSITIONAL_OR_KEYWORD", "type": "int", "default": "<required>"}], "returns": "None"}}
    opt = {"f": {**old["f"], "params": old["f"]["params"] + [{"name": "b", "kind": "KEYWORD_ONLY", "type": "int", "default": "0"}]}}
    req = {"f": {**old["f"], "params": old["f"]["params"] + [{"name": "b", "kind": "KEYWORD_ONLY", "type": "int", "default": "<required>"}]}}
    assert contracts.compare("c", old, opt) == ([], ["c.f: new optional parameter `b`"])
    assert contracts.compare("c", old, req)[0] == ["c.f: new required parameter `b`"]


def test_a_new_major_snapshot_lets_a_breaking_change_through(snapshots, monkeypatch):
    _swap(monkeypatch, "hooks", "plyx_samplers", None)
    assert not contracts.check_snapshots(snapshots).ok
    real_versions = contracts._version
    monkeypatch.setattr(contracts, "_version", lambda c: "2.0" if c == "hooks" else real_versions(c))
    assert not contracts.check_snapshots(snapshots).ok  # v2 not written yet
    contracts.write_snapshots(snapshots)
    assert (snapshots / "hooks" / "v2.json").exists() and (snapshots / "hooks" / "v1.json").exists()
    assert contracts.check_snapshots(snapshots).ok
