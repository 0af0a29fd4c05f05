"""Frozen contracts: additive changes pass, breaking ones are caught."""

from __future__ import annotations

import json
import sys
import typing
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


def _new_hook():
    def plyx_brand_new_hook(x: int) -> None:
        """new"""

    plyx_brand_new_hook.plyx_spec = {"firstresult": False, "historic": False}  # type: ignore[attr-defined]
    return plyx_brand_new_hook


def test_check_is_read_only_and_record_additive_records(snapshots, monkeypatch):
    _swap(monkeypatch, "hooks", "plyx_brand_new_hook", _new_hook())
    before = {p: p.read_bytes() for p in snapshots.rglob("*.json")}
    report = contracts.check_snapshots(snapshots)
    assert report.ok and report.additive == ("hooks",)
    assert {p: p.read_bytes() for p in snapshots.rglob("*.json")} == before  # nothing written
    recorded = contracts.record_additive(snapshots)
    assert recorded.ok
    assert "plyx_brand_new_hook" in json.loads((snapshots / "hooks" / "v1.json").read_text())["surface"]
    assert all("unchanged" in line for line in contracts.check_snapshots(snapshots).lines)


def test_record_additive_writes_nothing_when_another_contract_breaks(snapshots, monkeypatch):
    real = contracts._objects

    def patched():
        objs = real()
        objs["hooks"]["plyx_brand_new_hook"] = _new_hook()  # additive
        objs["hooks"].pop("plyx_samplers")  # breaking, same run
        return objs

    monkeypatch.setattr(contracts, "_objects", patched)
    before = {p: p.read_bytes() for p in snapshots.rglob("*.json")}
    report = contracts.record_additive(snapshots)
    assert not report.ok and "nothing recorded" in report.lines[-1]
    assert {p: p.read_bytes() for p in snapshots.rglob("*.json")} == before


def test_snapshot_refuses_to_overwrite_a_frozen_major_with_a_breaking_change(snapshots, monkeypatch):
    _swap(monkeypatch, "hooks", "plyx_samplers", None)
    before = {p: p.read_bytes() for p in snapshots.rglob("*.json")}
    with pytest.raises(contracts.SnapshotRefused, match="hooks v1"):
        contracts.write_snapshots(snapshots)
    assert {p: p.read_bytes() for p in snapshots.rglob("*.json")} == before
    assert not contracts.check_snapshots(snapshots).ok


def test_snapshot_rewrites_a_frozen_major_for_an_additive_change(snapshots, monkeypatch):
    _swap(monkeypatch, "hooks", "plyx_brand_new_hook", _new_hook())
    contracts.write_snapshots(snapshots)
    assert "plyx_brand_new_hook" in json.loads((snapshots / "hooks" / "v1.json").read_text())["surface"]


def test_cli_check_is_read_only_and_snapshot_refusal_exits_1(snapshots, monkeypatch, capsys):
    from plyx.specs.cli import main

    _swap(monkeypatch, "hooks", "plyx_brand_new_hook", _new_hook())
    before = (snapshots / "hooks" / "v1.json").read_bytes()
    assert main(["contracts", "check", "--dir", str(snapshots)]) == 0
    assert (snapshots / "hooks" / "v1.json").read_bytes() == before
    assert "record-additive" in capsys.readouterr().out
    assert main(["contracts", "record-additive", "--dir", str(snapshots)]) == 0
    assert (snapshots / "hooks" / "v1.json").read_bytes() != before
    _swap(monkeypatch, "hooks", "plyx_samplers", None)
    assert main(["contracts", "snapshot", "--dir", str(snapshots)]) == 1
    assert "refusing to overwrite" in capsys.readouterr().err


def test_a_new_member_of_an_implemented_protocol_is_breaking(snapshots, monkeypatch):
    from plyx.specs.kvcache import KVCache

    def shared_prefix(self, seq_ids: list[int]) -> int:
        """tokens shared by all of seq_ids"""
        ...

    members = {k: v for k, v in vars(KVCache).items() if not k.startswith("_")}
    grown = typing.runtime_checkable(type("KVCache", (Protocol,), {**members, "shared_prefix": shared_prefix}))
    _swap(monkeypatch, "kvcache", "KVCache", grown)
    report = contracts.check_snapshots(snapshots)
    assert not report.ok
    assert any("KVCache.shared_prefix: new required member of a protocol" in line for line in report.lines)


def test_an_optional_capability_as_a_separate_protocol_is_additive(snapshots, monkeypatch):
    class SharesPrefix(Protocol):
        def shared_prefix(self, seq_ids: list[int]) -> int: ...

    _swap(monkeypatch, "kvcache", "SharesPrefix", SharesPrefix)
    report = contracts.check_snapshots(snapshots)
    assert report.ok and report.additive == ("kvcache",)


def test_a_new_optional_parameter_of_a_protocol_member_is_breaking_of_a_function_additive():
    param = {"name": "a", "kind": "POSITIONAL_OR_KEYWORD", "type": "int", "default": "<required>"}
    extra = {"name": "b", "kind": "KEYWORD_ONLY", "type": "int", "default": "0"}
    method = {"params": [param], "returns": "None"}
    old = {"P": {"kind": "protocol", "members": {"m": method}}}
    new = {"P": {"kind": "protocol", "members": {"m": {**method, "params": [param, extra]}}}}
    breaks, adds = contracts.compare("c", old, new)
    assert breaks and "existing implementations" in breaks[0] and not adds


def test_constant_maps_compare_structure_not_repr(snapshots, monkeypatch):
    import attrs
    from plyx.specs.batch import BATCH_SPECS
    from plyx.specs.tensorspec import TensorSpec

    @attrs.frozen
    class Grown(TensorSpec):  # a TensorSpec that gained an optional field
        strides: tuple | None = None

    Grown.__name__ = "TensorSpec"
    grown = {k: Grown(v.shape, v.dtype, v.layout, v.name) for k, v in BATCH_SPECS.items()}
    _swap(monkeypatch, "batch", "BATCH_SPECS", grown)
    report = contracts.check_snapshots(snapshots)
    assert report.ok, report.lines
    assert any("input_ids.strides: new field" in line for line in report.lines)
    t = BATCH_SPECS["targets"]
    changed = {**grown, "targets": Grown(("B",), t.dtype, t.layout, "targets")}
    _swap(monkeypatch, "batch", "BATCH_SPECS", changed)
    report = contracts.check_snapshots(snapshots)
    assert not report.ok and any("targets.shape: changed" in line for line in report.lines)


def test_constant_maps_recorded_as_repr_text_by_older_snapshots_still_compare_by_structure():
    old = {"M": {"kind": "constant-map", "values": {"x": "TensorSpec(shape=('B', 'T'), dtype=None, layout='any', name='x')"}}}
    new = {"M": {"kind": "constant-map", "values": {"x": {"type": "TensorSpec", "fields": {
        "shape": "('B', 'T')", "dtype": "None", "layout": "'any'", "name": "'x'", "strides": "None"}}}}}
    breaks, adds = contracts.compare("batch", old, new)
    assert not breaks and adds == ["batch.M.x.strides: new field (None)"]


def test_behaviour_is_frozen_capability_refusal_ignoring_dtypes_fails_the_gate(snapshots, monkeypatch):
    from plyx.specs.kernels import Capability

    real = Capability.refusal

    def ignores_dtypes(self, query):
        return real(attrs_evolve(self, dtypes=frozenset()), query)

    import attrs

    attrs_evolve = attrs.evolve
    monkeypatch.setattr(Capability, "refusal", ignores_dtypes)
    report = contracts.check_snapshots(snapshots)
    assert not report.ok
    assert any("kernels behaviour: Capability[cuda-bf16-sm80].refusal(cuda-f32-sm90) accepts: was False, now True"
               in line for line in report.lines)


@pytest.mark.skipif(sys.version_info[:2] != (3, 11),
                    reason="the snapshots are recorded on the torch Python (3.11, the contracts session); "
                           "type names may print differently on others")
def test_the_repository_snapshots_pass_read_only():
    from pathlib import Path

    root = Path(__file__).resolve().parents[3] / "contracts"
    report = contracts.check_snapshots(root)
    assert report.ok, "\n".join(report.lines)


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
