"""Canonical JSON and content identifiers (stdlib only, same bytes on Python 3.10 to 3.13).

The encoding is the JSON Canonicalization Scheme of RFC 8785 (JCS), chosen so
that anyone can recompute a plyx content id with an off-the-shelf JCS library:

- objects: members sorted by key, keys compared as sequences of UTF-16 code
  units (RFC 8785 section 3.2.3; this differs from code-point order only for
  characters above U+FFFF, which sort before U+E000..U+FFFF); duplicate keys
  cannot occur (Python dicts); keys must be strings;
- no insignificant whitespace: ``,`` and ``:`` separators, nothing else;
- strings: UTF-8, every character literal except ``"``, ``\\`` and the controls
  U+0000..U+001F, which are escaped as ``\\b \\t \\n \\f \\r`` or ``\\u00xx``
  (lower-case hex); lone surrogates are refused (they have no UTF-8 form);
- floats: the ECMAScript ``Number.prototype.toString`` form (shortest digits
  that round-trip, ``1e+21`` exponents, ``-0`` written ``0``); NaN and
  infinities are refused;
- integers: exact decimal digits. Within +-(2**53 - 1) this is what JCS
  writes; larger integers (64-bit seeds) are kept exact, where a JCS library
  working on doubles would round them. This is the one documented departure.
- ``true``, ``false``, ``null``; lists and tuples are arrays in their order.

A content id is ``"sha256:" + hex(sha256(canonical_json(document)))``, where a
receipt's own ``content_id`` member is left out before hashing.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from typing import Any

from plyx.governance._errors import GovernanceError

__all__ = ["canonical_json", "content_id", "CONTENT_ID_FIELD"]

CONTENT_ID_FIELD = "content_id"


def _es_number(x: float, path: str) -> str:
    """ECMAScript Number::toString of a finite double (ECMA-262 section 7.1.12.1)."""
    if math.isnan(x) or math.isinf(x):
        raise GovernanceError(path, "NaN and infinities have no JSON form", value=x,
                              fix="store it as a string or leave the field out")
    if x == 0:
        return "0"  # -0 too
    sign = "-" if x < 0 else ""
    # repr() gives the shortest digits that round-trip (Python >= 3.1), the same
    # digit string ECMAScript asks for; only the layout differs.
    mantissa, _, exp_text = repr(abs(x)).partition("e")
    int_part, _, frac_part = mantissa.partition(".")
    all_digits = int_part + frac_part
    # value = 0.<all_digits> * 10**n
    n = len(int_part) + (int(exp_text) if exp_text else 0)
    stripped = all_digits.lstrip("0")
    n -= len(all_digits) - len(stripped)
    digits = stripped.rstrip("0")
    k = len(digits)
    if k <= n <= 21:
        text = digits + "0" * (n - k)
    elif 0 < n <= 21:
        text = digits[:n] + "." + digits[n:]
    elif -6 < n <= 0:
        text = "0." + "0" * (-n) + digits
    else:
        e = n - 1
        text = digits[0] + ("." + digits[1:] if k > 1 else "") + ("e+" if e >= 0 else "e-") + str(abs(e))
    return sign + text


def _string(s: str, path: str) -> str:
    # json.dumps(ensure_ascii=False) escapes exactly '"', '\\' and U+0000..U+001F,
    # with the short forms for \b \t \n \f \r and lower-case \u00xx otherwise:
    # the JSON.stringify rules that RFC 8785 adopts.
    text = json.dumps(s, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise GovernanceError(path, "string holds a lone surrogate, which has no UTF-8 form",
                              value=s, fix="decode the source text with errors='replace'") from exc
    return text


def _utf16_key(key: str) -> bytes:
    return key.encode("utf-16-be", "surrogatepass")


def _encode(value: Any, path: str, out: list[str]) -> None:
    if value is None:
        out.append("null")
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif isinstance(value, int):
        out.append(str(int(value)))
    elif isinstance(value, float):
        out.append(_es_number(value, path))
    elif isinstance(value, str):
        out.append(_string(value, path))
    elif isinstance(value, Mapping):
        for key in value:
            if not isinstance(key, str):
                raise GovernanceError(f"{path}", "object keys must be strings", value=key,
                                      fix="convert the key with str() before writing the document")
        out.append("{")
        for i, key in enumerate(sorted(value, key=_utf16_key)):
            if i:
                out.append(",")
            out.append(_string(key, path))
            out.append(":")
            _encode(value[key], f"{path}.{key}", out)
        out.append("}")
    elif isinstance(value, (list, tuple)):
        out.append("[")
        for i, item in enumerate(value):
            if i:
                out.append(",")
            _encode(item, f"{path}[{i}]", out)
        out.append("]")
    else:
        raise GovernanceError(path, f"{type(value).__name__} has no JSON form", value=value,
                              fix="convert it to str, int, float, bool, None, list or dict first")


def canonical_json(value: Any) -> bytes:
    """The canonical UTF-8 JSON bytes of ``value`` (RFC 8785; see the module docstring).

    Example:
        >>> canonical_json({"b": [1.0, 2.5e-7], "a": "é"}).decode()
        '{"a":"é","b":[1,2.5e-7]}'
    """
    out: list[str] = []
    _encode(value, "$", out)
    return "".join(out).encode("utf-8")


def content_id(document: Mapping[str, Any]) -> str:
    """``sha256:<hex>`` of the canonical JSON of ``document`` without its ``content_id`` member."""
    body = {k: v for k, v in document.items() if k != CONTENT_ID_FIELD}
    return "sha256:" + hashlib.sha256(canonical_json(body)).hexdigest()
