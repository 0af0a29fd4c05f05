"""Canonical JSON (RFC 8785) and content ids: published vectors, and the same bytes on every Python."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import textwrap
from pathlib import Path

import pytest
from plyx.governance import GovernanceError, canonical_json, content_id

# RFC 8785 Appendix B: IEEE 754 bit patterns and their canonical form
APPENDIX_B = [
    ("0000000000000000", "0"),
    ("8000000000000000", "0"),
    ("0000000000000001", "5e-324"),
    ("8000000000000001", "-5e-324"),
    ("7fefffffffffffff", "1.7976931348623157e+308"),
    ("ffefffffffffffff", "-1.7976931348623157e+308"),
    ("4340000000000000", "9007199254740992"),
    ("c340000000000000", "-9007199254740992"),
    ("4430000000000000", "295147905179352830000"),
    ("44b52d02c7e14af5", "9.999999999999997e+22"),
    ("44b52d02c7e14af6", "1e+23"),
    ("44b52d02c7e14af7", "1.0000000000000001e+23"),
    ("444b1ae4d6e2ef4e", "999999999999999700000"),
    ("444b1ae4d6e2ef4f", "999999999999999900000"),
    ("444b1ae4d6e2ef50", "1e+21"),
    ("3eb0c6f7a0b5ed8c", "9.999999999999997e-7"),
    ("3eb0c6f7a0b5ed8d", "0.000001"),
    ("41b3de4355555553", "333333333.3333332"),
    ("41b3de4355555554", "333333333.33333325"),
    ("41b3de4355555555", "333333333.3333333"),
    ("41b3de4355555556", "333333333.3333334"),
    ("41b3de4355555557", "333333333.33333343"),
    ("becbf647612f3696", "-0.0000033333333333333333"),
    ("43143ff3c1cb0959", "1424953923781206.2"),
]


@pytest.mark.parametrize(("bits", "expected"), APPENDIX_B)
def test_rfc8785_appendix_b_numbers(bits: str, expected: str) -> None:
    value = struct.unpack(">d", bytes.fromhex(bits))[0]
    assert canonical_json(value) == expected.encode()


# json-canonicalization (the RFC author's reference) testdata: input text -> canonical text
REFERENCE = [
    (r'''{"numbers": [1E30, 4.50, 333333333.33333329, 2e-3, 0.000000000000000000000000001],
        "escaping": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
        "literals": [null, true, false]}''',
     '{"escaping":"€$\\u000f\\nA\'B\\"\\\\\\\\\\"/","literals":[null,true,false],'
     '"numbers":[1e+30,4.5,333333333.3333333,0.002,1e-27]}'),
    # keys sort by UTF-16 code units: U+1F602 (D83D DE02) comes before U+FB33
    (r'''{"\u20ac": "Euro Sign", "1": "One", "\u0080": "Control\u007f", "\ud83d\ude02": "Smiley",
        "\u00f6": "Latin Small Letter O With Diaeresis", "\ufb33": "Hebrew Letter Dalet With Dagesh",
        "</script>": "Browser Challenge"}''',
     '{"1":"One","</script>":"Browser Challenge","\u0080":"Control\u007f","ö":"Latin Small Letter O With Diaeresis",'
     '"€":"Euro Sign","\U0001f602":"Smiley","\ufb33":"Hebrew Letter Dalet With Dagesh"}'),
    (r'{"Unnormalized Unicode":"\u1e0d\u0307"}', '{"Unnormalized Unicode":"\u1e0d\u0307"}'),
    ('[56, {"d": true, "10": null, "1": [ ]}]', '[56,{"1":[],"10":null,"d":true}]'),
    ('{"peach": "This sorting order", "péché": "is wrong according to French", "pêche": "but canonicalization '
     'MUST", "sin": "ignore locale"}',
     '{"peach":"This sorting order","péché":"is wrong according to French","pêche":"but canonicalization MUST",'
     '"sin":"ignore locale"}'),
]


@pytest.mark.parametrize(("source", "expected"), REFERENCE)
def test_reference_testdata(source: str, expected: str) -> None:
    assert canonical_json(json.loads(source)) == expected.encode("utf-8")


def test_utf16_order_differs_from_code_point_order() -> None:
    # the one case where Python's default sort would be wrong
    doc = {"\ufb33": 1, "\U0001f602": 2}
    assert canonical_json(doc) == '{"\U0001f602":2,"\ufb33":1}'.encode()
    assert sorted(doc) == ["\ufb33", "\U0001f602"]


def test_no_whitespace_and_utf8_literals() -> None:
    out = canonical_json({"b": [1, 2, {"z": None, "a": "é\t\x1f"}], "a": True})
    assert out == b'{"a":true,"b":[1,2,{"a":"\xc3\xa9\\t\\u001f","z":null}]}'


def test_big_integers_stay_exact() -> None:
    assert canonical_json(2**64 + 1) == b"18446744073709551617"
    assert canonical_json(-(2**63)) == b"-9223372036854775808"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_numbers_are_refused(bad: float) -> None:
    with pytest.raises(GovernanceError, match=r"\$\.metrics\.loss"):
        canonical_json({"metrics": {"loss": bad}})


@pytest.mark.parametrize(("value", "where"), [({1: "x"}, "$"), ({"a": [b"x"]}, r"$.a[0]"), ("\ud800", "$")])
def test_unrepresentable_values_name_their_path(value: object, where: str) -> None:
    with pytest.raises(GovernanceError) as info:
        canonical_json(value)
    assert info.value.what == where


# A receipt-shaped document and its canonical bytes, derived by hand from the
# rules (sorted keys, no whitespace, ES number forms): the matrix runs this on
# 3.10-3.13, so a change of bytes on any Python fails here.
GOLDEN_DOC = {
    "schema": "plyx.governance.receipt/1",
    "seeds": {"torch": 2**63 + 11, "python": 0},
    "metrics": {"loss": 2.75, "lr": 3e-4, "tiny": 1e-7, "big": 1e21, "neg_zero": -0.0, "third": 1 / 3},
    "name": "modèle ✓ \U0001f600",
    "inputs": [{"path": "data/a.txt", "size": 12}],
    "ok": True,
    "none": None,
    "content_id": "ignored when hashing",
}
GOLDEN_BYTES = (
    '{"inputs":[{"path":"data/a.txt","size":12}],'
    '"metrics":{"big":1e+21,"loss":2.75,"lr":0.0003,"neg_zero":0,"third":0.3333333333333333,"tiny":1e-7},'
    '"name":"modèle ✓ \U0001f600","none":null,"ok":true,"schema":"plyx.governance.receipt/1",'
    '"seeds":{"python":0,"torch":9223372036854775819}}'
).encode("utf-8")


def test_content_id_is_sha256_of_canonical_bytes_without_itself() -> None:
    body = {k: v for k, v in GOLDEN_DOC.items() if k != "content_id"}
    assert canonical_json(body) == GOLDEN_BYTES
    assert content_id(GOLDEN_DOC) == "sha256:" + hashlib.sha256(GOLDEN_BYTES).hexdigest()
    # key order and the layout of the stored JSON do not matter; any value does
    shuffled = json.loads(json.dumps(dict(reversed(list(GOLDEN_DOC.items()))), indent=3))
    assert content_id(shuffled) == content_id(GOLDEN_DOC)
    assert content_id({**GOLDEN_DOC, "ok": False}) != content_id(GOLDEN_DOC)


def _other_pythons() -> list[str]:
    found = {}
    candidates = [shutil.which(f"python3.{minor}") for minor in range(10, 14)]
    candidates += [str(p) for p in sorted(Path(os.path.expanduser("~/.pyenv/versions")).glob("3.1[0-3]*/bin/python3"))]
    for exe in filter(None, candidates):
        try:
            version = subprocess.run([exe, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                                     text=True, timeout=20, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            continue  # a pyenv shim without that version behind it
        found.setdefault(version, exe)
    return sorted(found.values())


def test_same_bytes_on_every_local_python() -> None:
    """The module is stdlib-only: run its source on each local CPython 3.10-3.13 and compare bytes."""
    pythons = _other_pythons()
    if not pythons:
        pytest.skip("no other CPython 3.10-3.13 found on this machine (the matrix covers them)")
    import plyx.governance._canonical as module

    script = textwrap.dedent(f"""
        import json, sys, types
        # stand-in for the one plyx import, so the module runs on a bare interpreter
        errors = types.ModuleType("plyx.governance._errors")
        class GovernanceError(ValueError):
            def __init__(self, what, problem, **kw): super().__init__(what, problem)
        errors.GovernanceError = GovernanceError
        sys.modules["plyx.governance._errors"] = errors
        ns = {{"__name__": "canonical"}}
        exec(compile(open({str(module.__file__)!r}, encoding="utf-8").read(), "canonical", "exec"), ns)
        doc = json.loads(sys.stdin.read())
        sys.stdout.write(ns["canonical_json"](doc).hex() + " " + ns["content_id"](doc))
    """)
    expected = f"{canonical_json(GOLDEN_DOC).hex()} {content_id(GOLDEN_DOC)}"
    for exe in pythons:
        done = subprocess.run([exe, "-c", script], input=json.dumps(GOLDEN_DOC), capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout == expected, f"{exe} produced different canonical bytes"
