"""SBOM packages say where they came from (PEP 610 ``direct_url.json``), like syft: a local build is not a PyPI
package, a VCS or archive install carries its URL; the interpreter is a package and files have SPDX types."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import pytest
from plyx.governance import build_cyclonedx, build_spdx, validate_spdx, write_sbom
from plyx.governance._environment import Distribution, installed_distributions
from plyx.governance._sbom import purl

VCS = {"url": "https://github.com/acme/tok.git", "vcs_info": {"vcs": "git", "commit_id": "0123abcd" * 5}}
ARCHIVE = {"url": "https://files.example.org/tok-1.0.tar.gz", "archive_info": {"hashes": {"sha256": "ab" * 32}}}
LOCAL = {"url": "file:///src/plyx/packages/specs", "dir_info": {"editable": True}}


def _dist(name: str, source: dict | None) -> Distribution:
    return Distribution(name=name, version="1.0+local", direct_url=json.dumps(source) if source else "")


@pytest.mark.parametrize(("source", "expected"), [
    (None, "pkg:pypi/tok@1.0%2Blocal"),
    (VCS, "pkg:pypi/tok@1.0%2Blocal?vcs_url=git%2Bhttps://github.com/acme/tok.git%40" + "0123abcd" * 5),
    (ARCHIVE, "pkg:pypi/tok@1.0%2Blocal?checksum=sha256:" + "ab" * 32
     + "&download_url=https://files.example.org/tok-1.0.tar.gz"),
    (LOCAL, "pkg:generic/tok@1.0%2Blocal?download_url=file:///src/plyx/packages/specs"),
])
def test_purl_records_where_a_distribution_came_from(source, expected):
    assert purl(_dist("tok", source)) == expected


def test_installed_distributions_read_direct_url_json():
    mine = next(d for d in installed_distributions() if d.name == "plyx-governance")
    from importlib.metadata import distribution

    raw = distribution("plyx-governance").read_text("direct_url.json")
    if raw is None:
        assert mine.source() is None and purl(mine).startswith("pkg:pypi/plyx-governance@")
    else:  # a development install from this source tree: never a pkg:pypi PURL
        assert mine.source()["url"] == json.loads(raw)["url"]
        assert not purl(mine).startswith("pkg:pypi/") or "vcs_url=" in purl(mine) or "download_url=" in purl(mine)


def test_spdx_records_sources_the_interpreter_and_file_types(tmp_path: Path):
    (tmp_path / "model.onnx").write_bytes(b"\x00" * 64)
    (tmp_path / "MODEL_CARD.md").write_text("# card\n")
    (tmp_path / "config.json").write_text("{}")
    dists = [_dist("tok", VCS), _dist("arc", ARCHIVE), _dist("loc", LOCAL), _dist("idx", None)]
    out = write_sbom(tmp_path / "SBOM.spdx.json", "rel", files=[tmp_path / n for n in
                                                                ("model.onnx", "MODEL_CARD.md", "config.json")])
    assert validate_spdx(out).ok  # spdx-tools accepts the new fields on the real environment
    doc = build_spdx("rel", files=[tmp_path / "model.onnx", tmp_path / "MODEL_CARD.md", tmp_path / "config.json"],
                     base=tmp_path, distributions=dists)
    pkgs = {p["name"]: p for p in doc["packages"]}
    assert pkgs["tok"]["downloadLocation"] == "git+https://github.com/acme/tok.git@" + "0123abcd" * 5
    assert pkgs["arc"]["downloadLocation"] == ARCHIVE["url"]
    assert "local directory file:///src/plyx/packages/specs" in pkgs["loc"]["sourceInfo"]
    assert pkgs["idx"]["downloadLocation"] == "NOASSERTION" and "sourceInfo" not in pkgs["idx"]
    py = pkgs["python"]
    assert py["versionInfo"] == platform.python_version() and py["primaryPackagePurpose"] == "APPLICATION"
    assert py["externalRefs"][0]["referenceLocator"] == f"pkg:generic/python@{platform.python_version()}"
    types = {f["fileName"]: f["fileTypes"] for f in doc["files"]}
    assert types == {"./MODEL_CARD.md": ["DOCUMENTATION"], "./config.json": ["TEXT"], "./model.onnx": ["BINARY"]}
    cdx = build_cyclonedx("rel", distributions=dists)
    apps = [c for c in cdx["components"] if c["type"] == "application"]
    assert [c["name"] for c in apps] == ["python"]
    assert {c["purl"] for c in cdx["components"] if c["type"] == "library"} == {purl(d) for d in dists}
