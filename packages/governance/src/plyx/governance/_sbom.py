"""SBOMs of the current environment: SPDX 2.3 JSON (validated with spdx-tools) and CycloneDX 1.5 JSON.

The SPDX document describes one root package, the release (``--name``),
which CONTAINS the given artifact files (SHA1 + SHA256 each; SPDX 2.3
requires SHA1) and DEPENDS_ON every installed distribution; distributions
DEPENDS_ON each other following their ``Requires-Dist`` (extras left out).
Each distribution carries its version, a PURL saying where it came from
(``purl``: ``pkg:pypi`` from an index; with a ``vcs_url`` or ``download_url``
qualifier when PEP 610's ``direct_url.json`` says it was installed from a VCS or
an archive URL; ``pkg:generic`` with the ``download_url`` of a local directory,
which no index serves) and its declared licence when that is a valid SPDX
expression. Like syft's output, the Python interpreter is a package too
(``pkg:generic/python@X.Y.Z``) and every file has SPDX ``fileTypes``.

Timestamps honour ``SOURCE_DATE_EPOCH`` and the namespace is a UUIDv5 of the
content, so the same environment and files give the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

from plyx.governance._canonical import canonical_json
from plyx.governance._clock import utc_now
from plyx.governance._environment import Distribution, installed_distributions, normalize_name
from plyx.governance._errors import GovernanceError
from plyx.governance._files import digest_file, portable_relpath, write_text_atomic
from plyx.governance._licenses import declared_license
from plyx.governance._report import Report

__all__ = [
    "SBOM_FILE",
    "CYCLONEDX_FILE",
    "build_spdx",
    "build_cyclonedx",
    "write_sbom",
    "validate_spdx",
    "purl",
]

SBOM_FILE = "SBOM.spdx.json"
CYCLONEDX_FILE = "SBOM.cdx.json"
_NAMESPACE_ROOT = uuid.UUID("6d1b3b1e-4f0a-5c55-9b6e-706c79782d67")  # fixed: namespaces derive from it
_HTTP = re.compile(r"^https?://[^\s]+$")


def _tool() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"plyx-governance-{version('plyx-governance')}"
    except PackageNotFoundError:  # a source tree on sys.path
        return "plyx-governance-unknown"


def _q(value: str) -> str:
    """A PURL qualifier value, percent-encoded (``+`` -> ``%2B``, ``@`` -> ``%40``)."""
    return quote(value, safe=":/")


def _vcs_location(info: dict[str, Any]) -> str:
    """``git+https://host/repo@commit`` (the SPDX / pip form) of a VCS install."""
    vcs = info.get("vcs_info") or {}
    where = f"{vcs.get('vcs', 'git')}+{info['url']}"
    return f"{where}@{vcs['commit_id']}" if vcs.get("commit_id") else where


def purl(dist: Distribution) -> str:
    """The package URL of an installed distribution, saying where it came from.

    ``pkg:pypi/<normalized name>@<version>`` (version percent-encoded, ``+`` -> ``%2B``) for one
    installed from an index; plus ``?vcs_url=`` for a VCS install and ``?checksum=...&download_url=``
    for an archive URL (PEP 610); ``pkg:generic/...?download_url=file:...`` for a local directory.
    """
    name, version = normalize_name(dist.name), quote(dist.version, safe=".-_~")
    info = dist.source()
    if info is None:
        return f"pkg:pypi/{name}@{version}"
    if "vcs_info" in info:
        return f"pkg:pypi/{name}@{version}?vcs_url={_q(_vcs_location(info))}"
    if "dir_info" in info:  # a local source tree: no index serves this build
        return f"pkg:generic/{name}@{version}?download_url={_q(info['url'])}"
    qualifiers = {"download_url": info["url"]}
    archive = info.get("archive_info") or {}
    hashes = dict(archive.get("hashes") or {})
    if not hashes and isinstance(archive.get("hash"), str) and "=" in archive["hash"]:  # PEP 610's legacy form
        alg, _, value = archive["hash"].partition("=")
        hashes[alg] = value
    if "sha256" in hashes:
        qualifiers["checksum"] = f"sha256:{hashes['sha256']}"
    return f"pkg:pypi/{name}@{version}?" + "&".join(f"{k}={_q(v)}" for k, v in sorted(qualifiers.items()))


def _source_fields(dist: Distribution) -> dict[str, str]:
    """SPDX ``downloadLocation`` / ``sourceInfo`` of a distribution installed from a URL (PEP 610)."""
    info = dist.source()
    if info is None:
        return {}
    if "vcs_info" in info:
        return {"downloadLocation": _vcs_location(info), "sourceInfo": "installed from a VCS URL (PEP 610)"}
    if "dir_info" in info:
        editable = " in editable mode" if (info.get("dir_info") or {}).get("editable") else ""
        return {"sourceInfo": f"installed{editable} from the local directory {info['url']} (PEP 610)"}
    return {"downloadLocation": info["url"], "sourceInfo": "installed from an archive URL (PEP 610)"}


# SPDX 2.3 file types by suffix (section 8.3); anything else is OTHER
_FILE_TYPES = {
    ".onnx": "BINARY", ".safetensors": "BINARY", ".bin": "BINARY", ".gguf": "BINARY", ".pt": "BINARY",
    ".so": "BINARY", ".json": "TEXT", ".jsonl": "TEXT", ".txt": "TEXT", ".dot": "TEXT", ".sha256": "TEXT",
    ".pub": "TEXT", ".toml": "TEXT", ".yaml": "TEXT", ".yml": "TEXT", ".md": "DOCUMENTATION",
    ".png": "IMAGE", ".py": "SOURCE", ".zip": "ARCHIVE", ".tar": "ARCHIVE", ".gz": "ARCHIVE",
}


def _file_type(rel: str) -> str:
    if rel.endswith(".spdx.json"):
        return "SPDX"
    return _FILE_TYPES.get(Path(rel).suffix.lower(), "OTHER")


def _python_package() -> dict[str, str]:
    """The interpreter, as syft's binary cataloger reports it."""
    version = platform.python_version()
    return {"name": "python", "version": version, "implementation": platform.python_implementation(),
            "purl": f"pkg:generic/python@{quote(version, safe='.-_~')}",
            # CPython is under the PSF licence; other implementations are left unasserted
            "license": "Python-2.0" if platform.python_implementation() == "CPython" else "NOASSERTION"}


def _spdx_id(prefix: str, text: str) -> str:
    # SPDX ids allow letters, digits, '.' and '-' only
    return f"SPDXRef-{prefix}-" + re.sub(r"[^A-Za-z0-9.-]+", "-", text).strip("-")


def _files(files: Sequence[str | os.PathLike[str]], base: Path) -> list[dict[str, Any]]:
    out = []
    for f in files:
        p = Path(f)
        if not p.is_file():
            raise GovernanceError("--files", f"{p} is not a file", fix="list the artifact files, not directories")
        rel = portable_relpath(p, base)
        if rel.startswith("../"):
            raise GovernanceError("--files", f"{p} is outside {base}, where the SBOM is written",
                                  fix="write the SBOM into the directory that holds the artifacts")
        out.append({"path": rel, "sha1": digest_file(p, "sha1"), "sha256": digest_file(p)})
    return sorted(out, key=lambda e: e["path"])


def build_spdx(name: str, *, files: Sequence[str | os.PathLike[str]] = (), base: str | os.PathLike[str] = ".",
               version: str = "", distributions: Sequence[Distribution] | None = None) -> dict[str, Any]:
    """The SPDX 2.3 document (a JSON-ready dict) of the environment and ``files``.

    Args:
        name: the release's name (the root package and the document name).
        files: artifact files the release contains; paths are written relative to ``base``.
        base: the directory the SBOM will sit in.
        version: the release's version, if it has one.
        distributions: what to describe; defaults to every installed distribution.
    """
    if not name or not name.strip():
        raise GovernanceError("--name", "the release needs a name", fix="pass --name NAME")
    dists = list(installed_distributions() if distributions is None else distributions)
    entries = _files(files, Path(base))
    root_id = _spdx_id("Package", "release-" + name)
    ids = {normalize_name(d.name): _spdx_id("Package", f"{normalize_name(d.name)}-{d.version}") for d in dists}
    packages: list[dict[str, Any]] = [{
        "SPDXID": root_id,
        "name": name,
        **({"versionInfo": version} if version else {}),
        "downloadLocation": "NOASSERTION",
        # SPDX lets only an analysed package CONTAIN files; the verification
        # code (SPDX 2.3 section 7.9) is sha1 over the sorted file sha1s
        "filesAnalyzed": True,
        "packageVerificationCode": {
            "packageVerificationCodeValue": hashlib.sha1("".join(sorted(e["sha1"] for e in entries)).encode()).hexdigest()
        },
        "licenseConcluded": "NOASSERTION",
        "licenseDeclared": "NOASSERTION",
        "copyrightText": "NOASSERTION",
        "primaryPackagePurpose": "OTHER",
        "comment": "The release: the artifact files below and the Python environment that produced them.",
    }]
    relationships = [{"spdxElementId": "SPDXRef-DOCUMENT", "relationshipType": "DESCRIBES",
                      "relatedSpdxElement": root_id}]
    for d in dists:
        license_id, comment = declared_license(d)
        pkg: dict[str, Any] = {
            "SPDXID": ids[normalize_name(d.name)],
            "name": d.name,
            "versionInfo": d.version,
            "downloadLocation": "NOASSERTION",
            "filesAnalyzed": False,
            "licenseConcluded": "NOASSERTION",
            "licenseDeclared": license_id,
            "licenseComments": comment,
            "copyrightText": "NOASSERTION",
            "primaryPackagePurpose": "LIBRARY",
            "externalRefs": [{"referenceCategory": "PACKAGE-MANAGER", "referenceType": "purl",
                              "referenceLocator": purl(d)}],
            **_source_fields(d),
        }
        if d.summary:
            pkg["summary"] = d.summary
        if _HTTP.match(d.homepage):
            pkg["homepage"] = d.homepage
        packages.append(pkg)
        relationships.append({"spdxElementId": root_id, "relationshipType": "DEPENDS_ON",
                              "relatedSpdxElement": pkg["SPDXID"]})
    py = _python_package()
    py_id = _spdx_id("Package", f"python-{py['version']}")
    packages.append({
        "SPDXID": py_id, "name": py["name"], "versionInfo": py["version"], "downloadLocation": "NOASSERTION",
        "filesAnalyzed": False, "licenseConcluded": "NOASSERTION", "licenseDeclared": py["license"],
        "copyrightText": "NOASSERTION", "primaryPackagePurpose": "APPLICATION",
        "comment": f"the {py['implementation']} interpreter that ran the build",
        "externalRefs": [{"referenceCategory": "PACKAGE-MANAGER", "referenceType": "purl",
                          "referenceLocator": py["purl"]}],
    })
    relationships.append({"spdxElementId": root_id, "relationshipType": "DEPENDS_ON", "relatedSpdxElement": py_id})
    for d in dists:
        for req in d.requires:
            if req in ids and req != normalize_name(d.name):
                relationships.append({"spdxElementId": ids[normalize_name(d.name)], "relationshipType": "DEPENDS_ON",
                                      "relatedSpdxElement": ids[req]})
    spdx_files = []
    for i, e in enumerate(entries):
        file_id = _spdx_id("File", f"{i}-{e['path']}")
        spdx_files.append({
            "SPDXID": file_id,
            "fileName": "./" + e["path"],
            "fileTypes": [_file_type(e["path"])],
            "checksums": [{"algorithm": "SHA1", "checksumValue": e["sha1"]},
                          {"algorithm": "SHA256", "checksumValue": e["sha256"]}],
            "licenseConcluded": "NOASSERTION",
            "copyrightText": "NOASSERTION",
        })
        relationships.append({"spdxElementId": root_id, "relationshipType": "CONTAINS", "relatedSpdxElement": file_id})
    # the namespace must be unique per document; deriving it from the content
    # keeps it unique across releases and stable across reruns
    seed = canonical_json({"name": name, "version": version, "packages": [[p["name"], p.get("versionInfo", "")]
                                                                          for p in packages], "files": entries})
    namespace = uuid.uuid5(_NAMESPACE_ROOT, seed.decode("utf-8"))
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", name)
    return {
        "spdxVersion": "SPDX-2.3",
        "dataLicense": "CC0-1.0",
        "SPDXID": "SPDXRef-DOCUMENT",
        "name": name,
        "documentNamespace": f"https://plyx.dev/spdx/{safe}-{namespace}",
        "creationInfo": {"created": utc_now(), "creators": [f"Tool: {_tool()}"]},
        "packages": packages,
        "files": spdx_files,
        "relationships": relationships,
    }


def build_cyclonedx(name: str, *, files: Sequence[str | os.PathLike[str]] = (), base: str | os.PathLike[str] = ".",
                    version: str = "", distributions: Sequence[Distribution] | None = None) -> dict[str, Any]:
    """The same inventory as a CycloneDX 1.5 JSON BOM (components, PURLs, licences, dependencies, file hashes)."""
    dists = list(installed_distributions() if distributions is None else distributions)
    entries = _files(files, Path(base))
    root_ref = f"release:{name}"
    refs = {normalize_name(d.name): purl(d) for d in dists}
    components: list[dict[str, Any]] = []
    for d in dists:
        license_id, _ = declared_license(d)
        comp: dict[str, Any] = {"type": "library", "bom-ref": refs[normalize_name(d.name)], "name": d.name,
                                "version": d.version, "purl": refs[normalize_name(d.name)]}
        if license_id != "NOASSERTION":
            comp["licenses"] = [{"expression": license_id}]
        components.append(comp)
    py = _python_package()
    components.append({"type": "application", "bom-ref": py["purl"], "name": py["name"], "version": py["version"],
                       "purl": py["purl"], "description": f"the {py['implementation']} interpreter that ran the build"})
    for e in entries:
        components.append({"type": "file", "bom-ref": f"file:{e['path']}", "name": e["path"],
                           "hashes": [{"alg": "SHA-1", "content": e["sha1"]}, {"alg": "SHA-256", "content": e["sha256"]}]})
    dependencies = [{"ref": root_ref, "dependsOn": sorted([*refs.values(), py["purl"]])}, {"ref": py["purl"],
                                                                                       "dependsOn": []}]
    for d in dists:
        dependencies.append({"ref": refs[normalize_name(d.name)],
                             "dependsOn": sorted(refs[r] for r in d.requires if r in refs and r != normalize_name(d.name))})
    seed = canonical_json({"name": name, "version": version, "components": components})
    return {
        "bomFormat": "CycloneDX",
        "specVersion": "1.5",
        "serialNumber": f"urn:uuid:{uuid.uuid5(_NAMESPACE_ROOT, seed.decode('utf-8'))}",
        "version": 1,
        "metadata": {
            "timestamp": utc_now(),
            "tools": {"components": [{"type": "application", "name": "plyx-governance",
                                      "version": _tool().rpartition("-")[2]}]},
            "component": {"type": "machine-learning-model", "bom-ref": root_ref, "name": name,
                          **({"version": version} if version else {})},
        },
        "components": components,
        "dependencies": dependencies,
    }


def write_sbom(out: str | os.PathLike[str], name: str, *, files: Sequence[str | os.PathLike[str]] = (),
               version: str = "", cyclonedx: str | os.PathLike[str] | None = None) -> Path:
    """Write the SPDX SBOM to ``out`` (and CycloneDX to ``cyclonedx`` when given); file paths relative to ``out``'s directory."""
    out = Path(out)
    doc = build_spdx(name, files=files, base=out.parent, version=version)
    write_text_atomic(out, json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
    if cyclonedx is not None:
        cdx = build_cyclonedx(name, files=files, base=Path(cyclonedx).parent, version=version)
        write_text_atomic(cyclonedx, json.dumps(cdx, indent=2, ensure_ascii=False) + "\n")
    return out


def validate_spdx(path: str | os.PathLike[str], *, report: Report | None = None, check_files: bool = True) -> Report:
    """Validate an SPDX document with spdx-tools (any message is a problem) and its file checksums.

    Args:
        path: the SBOM.
        report: add findings to this report instead of a new one.
        check_files: also recompute the SHA256 of every file the SBOM lists
            (relative to its directory) and compare.
    """
    from spdx_tools.spdx.parser.error import SPDXParsingError
    from spdx_tools.spdx.parser.parse_anything import parse_file
    from spdx_tools.spdx.validation.document_validator import validate_full_spdx_document

    path = Path(path)
    report = report if report is not None else Report(f"SBOM {path}")
    name = path.name
    if not path.is_file():
        report.fail(name, "missing", "SBOM not found; write it with `plyx governance sbom`")
        return report
    try:
        document = parse_file(str(path))
    except SPDXParsingError as exc:
        messages = exc.get_messages() if hasattr(exc, "get_messages") else [str(exc)]
        report.fail(name, "sbom", "spdx-tools cannot parse it: " + "; ".join(str(m) for m in messages[:5]))
        return report
    except Exception as exc:  # spdx-tools raises JSONDecodeError, KeyError... on broken files
        report.fail(name, "sbom", f"spdx-tools cannot parse it: {type(exc).__name__}: {exc}")
        return report
    messages = validate_full_spdx_document(document)
    if messages:
        shown = "; ".join(m.validation_message for m in messages[:5])
        more = f" (and {len(messages) - 5} more)" if len(messages) > 5 else ""
        report.fail(name, "sbom", f"spdx-tools reports {len(messages)} validation message(s): {shown}{more}")
    else:
        report.passed.append(f"{name}: valid SPDX {document.creation_info.spdx_version} "
                             f"({len(document.packages)} packages, {len(document.files)} files), spdx-tools")
    if check_files:
        for f in document.files:
            rel = f.name[2:] if f.name.startswith("./") else f.name
            want = next((c.value for c in f.checksums if c.algorithm.name == "SHA256"), None)
            target = path.parent / rel
            if want is None:
                continue
            if not target.is_file():
                report.fail(rel, "sbom", f"listed in {name} but not found")
            elif digest_file(target) != want:
                report.fail(rel, "sbom", f"sha256 differs from the one recorded in {name}")
    return report
