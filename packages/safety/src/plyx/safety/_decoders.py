"""Undo the encodings attackers wrap payloads in, so the decoded text can be rescanned.

Each decoder returns ``(name, start, end, decoded)`` for every piece of ``text``
it could decode: base64 (standard and URL-safe), hex (``41 42``, ``0x4142``,
``\\x41\\x42``), ROT13, leetspeak and letter-spaced words (``i g n o r e``).
Decoded bytes must be mostly printable UTF-8, which is what keeps random
identifiers from being "decoded" into noise.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import re

from plyx.safety._normalize import LEET

__all__ = ["decode_all", "printable"]

_B64 = re.compile(r"(?<![A-Za-z0-9+/=_\-])[A-Za-z0-9+/_\-]{16,}={0,2}(?![A-Za-z0-9+/=_\-])")
_HEX = re.compile(r"(?<![0-9A-Za-z])(?:0x)?[0-9A-Fa-f]{2}(?:[\s:,]?[0-9A-Fa-f]{2}){7,}(?![0-9A-Za-z])")
_HEX_ESC = re.compile(r"(?:\\x[0-9A-Fa-f]{2}){6,}")
_SPACED = re.compile(r"(?<!\w)(?:\w[ .\-]){3,}\w(?!\w)")
_LEET_TABLE = str.maketrans(LEET)
_ENCODED = re.compile(r"[0-9A-Fa-f\s:,x\\]{16,}|[A-Za-z0-9+/_\-]{16,}={0,2}")


def printable(s: str) -> bool:
    """True when ``s`` reads as text: >= 90% printable or whitespace, with letters in it."""
    if not s:
        return False
    good = sum(ch.isprintable() or ch in "\n\t\r" for ch in s)
    return good / len(s) >= 0.9 and sum(ch.isalpha() for ch in s) >= max(3, len(s) // 4)


def _as_text(raw: bytes) -> str | None:
    try:
        s = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if printable(s) or (s.isascii() and _ENCODED.fullmatch(s.strip())):
        return s  # text, or another encoded layer (hex inside base64) to peel next
    return None


def _base64(text: str) -> list[tuple[str, int, int, str]]:
    out = []
    for m in _B64.finditer(text):
        token = m.group()
        body = token.rstrip("=")
        if body.isalpha() and (body.islower() or body.isupper()):
            continue  # a plain word is not base64 worth decoding
        padded = body + "=" * (-len(body) % 4)
        try:
            raw = base64.b64decode(padded.replace("-", "+").replace("_", "/"), validate=True)
        except (binascii.Error, ValueError):
            continue
        decoded = _as_text(raw)
        if decoded:
            out.append(("base64", m.start(), m.end(), decoded))
    return out


def _hex(text: str) -> list[tuple[str, int, int, str]]:
    out = []
    for rx, strip in ((_HEX, re.compile(r"0x|[\s:,]")), (_HEX_ESC, re.compile(r"\\x"))):
        for m in rx.finditer(text):
            try:
                raw = bytes.fromhex(strip.sub("", m.group()))
            except ValueError:
                continue
            decoded = _as_text(raw)
            if decoded:
                out.append(("hex", m.start(), m.end(), decoded))
    return out


def _spaced(text: str) -> list[tuple[str, int, int, str]]:
    # collapse every letter-spaced run in place, so words spaced out one by one
    # ("i g n o r e   a l l") are rescanned together as a sentence
    collapsed = _SPACED.sub(lambda m: re.sub(r"[ .\-]", "", m.group()), text)
    return [("spaced", 0, len(text), collapsed)] if collapsed != text else []


def decode_all(text: str) -> list[tuple[str, int, int, str]]:
    """Every decodable piece of ``text``: ``(decoder, start, end, decoded_text)``."""
    found = _base64(text) + _hex(text) + _spaced(text)
    rot = codecs.decode(text, "rot13")
    if rot != text:
        found.append(("rot13", 0, len(text), rot))
    leet = text.translate(_LEET_TABLE)
    if leet != text:
        found.append(("leetspeak", 0, len(text), leet))
    return found
