"""SPDX 2.3 SBOMs validated by spdx-tools itself, and the CycloneDX twin."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
from cyclonedx.schema import SchemaVersion
from cyclonedx.validation.json import JsonStrictValidator
from plyx.governance import build_cyclonedx, build_spdx, validate_spdx, write_sbom
from plyx.governance._environment import Distribution, installed_distributions
from plyx.governance._licenses import declared_license
from plyx.governance._sbom import purl
from spdx_tools.spdx.parser.parse_anything import parse_file
from spdx_tools.spdx.validation.document_validator import validate_full_spdx_document


def test_sbom_of_this_environment_has_zero_spdx_tools_messages(tmp_path: Path, plyx) -> None:
    (tmp_path / "model.onnx").write_bytes(b"\x00onnx" * 100)
    out = tmp_path / "SBOM.spdx.json"
    assert plyx(["governance", "sbom", "--out", str(out), "--name", "toy llm", "--version", "0.1",
                 "--files", str(tmp_path / "model.onnx"), "--cyclonedx", str(tmp_path / "SBOM.cdx.json")]) == 0
    document = parse_file(str(out))
    assert validate_full_spdx_document(document) == []
    assert document.creation_info.spdx_version == "SPDX-2.3"
    doc = json.loads(out.read_text(encoding="utf-8"))
    installed = {d.name: d.version for d in installed_distributions()}
    listed = {p["name"]: p["versionInfo"] for p in doc["packages"][1:] if p["primaryPackagePurpose"] == "LIBRARY"}
    assert listed == installed  # every installed distribution, with its version
    assert {"plyx-governance", "plyx-specs", "cryptography", "spdx-tools"} <= set(listed)
    purls = {p["name"]: p["externalRefs"][0]["referenceLocator"] for p in doc["packages"][1:]}
    # from an index (a wheelhouse): pkg:pypi; from a source tree (an editable dev install): where it came from
    specs = next(d for d in installed_distributions() if d.name == "plyx-specs")
    assert purls["plyx-specs"] == purl(specs)
    assert purls["plyx-specs"].startswith("pkg:pypi/plyx-specs@" if specs.source() is None else "pkg:generic/plyx-specs@")
    # relationships: the document describes the release, which contains the file and depends on packages
    rels = {(r["spdxElementId"], r["relationshipType"], r["relatedSpdxElement"]) for r in doc["relationships"]}
    ids = {p["name"]: p["SPDXID"] for p in doc["packages"]}
    root = doc["packages"][0]["SPDXID"]
    assert ("SPDXRef-DOCUMENT", "DESCRIBES", root) in rels
    assert (root, "CONTAINS", doc["files"][0]["SPDXID"]) in rels
    assert (ids["plyx-governance"], "DEPENDS_ON", ids["cryptography"]) in rels
    assert (ids["plyx-governance"], "DEPENDS_ON", ids["plyx-specs"]) in rels
    assert doc["files"][0]["fileName"] == "./model.onnx"
    assert validate_spdx(out).ok
    # the CycloneDX twin against the official 1.5 schema (strict: no unknown properties)
    cdx = (tmp_path / "SBOM.cdx.json").read_text(encoding="utf-8")
    assert JsonStrictValidator(SchemaVersion.V1_5).validate_str(cdx) is None
    assert {c["name"] for c in json.loads(cdx)["components"] if c["type"] == "library"} == set(installed)


def _dist(name: str, version: str = "1.0", **kw: object) -> Distribution:
    return Distribution(name=name, version=version, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(("dist", "expected"), [
    (_dist("a", license_expression="mit OR apache-2.0"), "MIT OR Apache-2.0"),
    (_dist("b", license_text="Apache 2.0"), "Apache-2.0"),
    (_dist("c", license_text="BSD-3-Clause"), "BSD-3-Clause"),
    (_dist("d", license_classifiers=("License :: OSI Approved :: MIT License",)), "MIT"),
    (_dist("e", license_text="BSD", license_classifiers=("License :: OSI Approved :: BSD License",)), "NOASSERTION"),
    (_dist("f", license_text="Proprietary, see LICENSE"), "NOASSERTION"),
    (_dist("g", license_expression="LicenseRef-Custom"), "NOASSERTION"),
    (_dist("h"), "NOASSERTION"),
])
def test_declared_licenses_are_valid_spdx_or_noassertion(dist: Distribution, expected: str) -> None:
    found, comment = declared_license(dist)
    assert found == expected
    assert comment


def test_odd_metadata_still_validates(tmp_path: Path) -> None:
    dists = [
        _dist("Weird_Name.pkg", "2.13.0+cpu", license_text="BSD", requires=("other-pkg",)),
        _dist("other-pkg", "0.1.dev3", license_expression="MIT", homepage="not a url"),
        _dist("third", "1!2.0", license_classifiers=("License :: OSI Approved :: BSD License",
                                                     "License :: OSI Approved :: MIT License")),
    ]
    doc = build_spdx("release/with:odd chars", distributions=dists, base=tmp_path)
    path = tmp_path / "sbom.spdx.json"
    path.write_text(json.dumps(doc), encoding="utf-8")
    assert validate_full_spdx_document(parse_file(str(path))) == []
    assert purl(dists[0]) == "pkg:pypi/weird-name-pkg@2.13.0%2Bcpu"
    assert purl(dists[2]) == "pkg:pypi/third@1%212.0"
    for p in doc["packages"]:
        assert re.fullmatch(r"SPDXRef-[A-Za-z0-9.-]+", p["SPDXID"])


def test_reproducible_with_source_date_epoch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    dists = [_dist("a", license_expression="MIT")]
    (tmp_path / "m.bin").write_bytes(b"m")
    one = build_spdx("r", files=[tmp_path / "m.bin"], base=tmp_path, distributions=dists)
    two = build_spdx("r", files=[tmp_path / "m.bin"], base=tmp_path, distributions=dists)
    assert one == two
    assert one["creationInfo"]["created"] == "2023-11-14T22:13:20Z"
    (tmp_path / "m.bin").write_bytes(b"n")  # other content, other namespace
    assert build_spdx("r", files=[tmp_path / "m.bin"], base=tmp_path, distributions=dists)["documentNamespace"] \
        != one["documentNamespace"]


def test_invalid_documents_are_reported(tmp_path: Path) -> None:
    doc = build_spdx("r", distributions=[_dist("a", license_expression="MIT")], base=tmp_path)
    path = tmp_path / "SBOM.spdx.json"
    doc["packages"][1]["licenseDeclared"] = "Not-A-License"
    doc["relationships"].append({"spdxElementId": "SPDXRef-DOCUMENT", "relationshipType": "DESCRIBES",
                                 "relatedSpdxElement": "SPDXRef-nowhere"})
    path.write_text(json.dumps(doc), encoding="utf-8")
    report = validate_spdx(path)
    assert not report.ok
    assert report.problems[0].artifact == "SBOM.spdx.json"
    assert "Not-A-License" in report.problems[0].message
    path.write_text("{not json", encoding="utf-8")
    assert "cannot parse" in validate_spdx(path).problems[0].message


def test_files_outside_the_sbom_directory_are_refused(tmp_path: Path) -> None:
    (tmp_path / "m.bin").write_bytes(b"m")
    (tmp_path / "sub").mkdir()
    with pytest.raises(ValueError, match="outside"):
        write_sbom(tmp_path / "sub" / "SBOM.spdx.json", "r", files=[tmp_path / "m.bin"])


def test_cyclonedx_inventory_matches_spdx(tmp_path: Path) -> None:
    dists = [_dist("a", license_expression="MIT", requires=("b",)), _dist("b", "2.0+x")]
    (tmp_path / "m.bin").write_bytes(b"m")
    bom = build_cyclonedx("r", files=[tmp_path / "m.bin"], base=tmp_path, distributions=dists)
    assert bom["bomFormat"] == "CycloneDX" and bom["specVersion"] == "1.5"
    assert re.fullmatch(r"urn:uuid:[0-9a-f-]{36}", bom["serialNumber"])
    refs = {c["bom-ref"] for c in bom["components"]} | {bom["metadata"]["component"]["bom-ref"]}
    for dep in bom["dependencies"]:  # every reference resolves
        assert dep["ref"] in refs and set(dep["dependsOn"]) <= refs
    libs = {c["name"]: c for c in bom["components"] if c["type"] == "library"}
    assert libs["a"]["licenses"] == [{"expression": "MIT"}] and "licenses" not in libs["b"]
    assert libs["b"]["purl"] == "pkg:pypi/b@2.0%2Bx"
    assert {"ref": "pkg:pypi/a@1.0", "dependsOn": ["pkg:pypi/b@2.0%2Bx"]} in bom["dependencies"]
    validator = JsonStrictValidator(SchemaVersion.V1_5)
    assert validator.validate_str(json.dumps(bom)) is None
    bom["components"][0]["licenses"] = [{"expression": "MIT", "note": "not in the schema"}]
    assert validator.validate_str(json.dumps(bom)) is not None  # the validator does reject
    files = [c for c in bom["components"] if c["type"] == "file"]
    assert files[0]["hashes"][1] == {"alg": "SHA-256", "content": hashlib.sha256(b"m").hexdigest()}
