"""PII detectors: email, phone, payment card (Luhn), IBAN (MOD 97), national ids, IP addresses.

Each is a regex that finds candidates and a validator that keeps only what is
structurally real (a check digit, a registry length, an address that parses),
which is what keeps order numbers, dates and version strings out.

Entities overlap: an IBAN's digits after ``00`` look like an international
phone number, a card's first twelve digits may pass Aadhaar's Verhoeff check.
``PRIORITY`` orders the entities; a detector drops a candidate that overlaps a
validated entity of higher priority (``yields_to``), alone or inside ``pii``,
so one span is one entity.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping
from typing import Any

from plyx.safety._checksums import IBAN_LENGTHS, dni_ok, iban_ok, luhn_ok, verhoeff_ok
from plyx.safety._span import SpanDetector
from plyx.safety._types import DetectorOptionError, Finding

__all__ = [
    "EmailDetector",
    "PhoneDetector",
    "CreditCardDetector",
    "IbanDetector",
    "NationalIdDetector",
    "IpAddressDetector",
    "PiiDetector",
    "PII_ENTITIES",
    "PRIORITY",
]

Hit = tuple[str, int, int, float, str]

#: entity priority, highest first: where validated spans overlap, the higher one is the entity
PRIORITY = ("secrets", "credit_card", "iban", "national_id", "email", "ip_address", "phone")


class _PiiSpanDetector(SpanDetector):
    """A PII detector that gives way to higher-priority entities it can be confused with."""

    #: entities (keys of ``PII_ENTITIES``, higher in ``PRIORITY``) whose spans this detector never claims
    yields_to: tuple[str, ...] = ()

    def __init__(self) -> None:
        super().__init__()
        self._higher: list[SpanDetector] | None = None

    def _higher_detectors(self) -> list[SpanDetector]:
        if self._higher is None:  # built lazily: the entity table is defined below
            self._higher = [PII_ENTITIES[e]() for e in self.yields_to]
        return self._higher

    def detect(self, text: str, context: Mapping[str, Any] | None = None) -> list[Finding]:
        found = super().detect(text, context)
        if not found or not self.yields_to:
            return found
        taken = [(f.start, f.end) for d in self._higher_detectors() for f in d.detect(text, context)]
        return [f for f in found if all(f.end <= s or f.start >= e for s, e in taken)]

    def pending(self, text: str) -> int:
        # whether a candidate stands depends on the higher entities too: hold what they hold
        return min([super().pending(text)] + [d.pending(text) for d in self._higher_detectors()])

    def detect_own(self, text: str, context: Mapping[str, Any] | None = None) -> list[Finding]:
        """Candidates without giving way (for a caller that resolves overlaps by ``PRIORITY`` itself)."""
        return SpanDetector.detect(self, text, context)

    def pending_own(self, text: str) -> int:
        """``pending`` of this entity alone (for a caller that also holds what the higher ones hold)."""
        return SpanDetector.pending(self, text)


class EmailDetector(_PiiSpanDetector):
    """RFC 5321-shaped addresses, plus the bracketed obfuscations ``john [at] example [dot] com``."""

    name = "email"
    alphabet = r"[\w.%+\-@']"
    # a plain address is one run of address characters; an obfuscated one may
    # contain spaces once a bracket follows the local part ("john [at] ex")
    tail = r"[\w.%+\-@']*(?:[ \t]*(?:[\[({<][\w\s\[\](){}<>.@\-]*)?)?\Z"
    max_len = 254
    _LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    # the local part: RFC 5322 atext as people write it; an apostrophe only between
    # letters (o'brien), so quotes around an address stay outside it
    _LOCAL = r"[A-Za-z0-9._%+\-](?:[A-Za-z0-9._%+\-]|'(?=[A-Za-z0-9])){0,63}"
    _BEFORE = r"(?<![\w.%+\-])(?<!\w')"
    _PLAIN = re.compile(
        rf"{_BEFORE}{_LOCAL}@{_LABEL}(?:\.{_LABEL})*\.([A-Za-z]{{2,24}})(?![\w-])"
    )
    _AT = r"\s*[\[({<]\s*(?:at|@)\s*[\])}>]\s*"
    _DOT = r"(?:\s*[\[({<]\s*(?:dot|\.)\s*[\])}>]\s*|\.)"
    _OBFUSCATED = re.compile(
        rf"{_BEFORE}{_LOCAL}{_AT}{_LABEL}(?:{_DOT}{_LABEL})*{_DOT}([A-Za-z]{{2,24}})(?![\w-])",
        re.IGNORECASE,
    )
    # file extensions that are not top-level domains: logo@2x.png is an image, not an address
    _FILE_EXTENSIONS = frozenset({"png", "jpg", "jpeg", "gif", "svg", "webp", "bmp", "ico", "tif", "tiff", "avif",
                                  "heic", "pdf", "css", "js", "mjs", "ts", "json", "yaml", "yml", "toml", "html",
                                  "htm", "txt", "csv", "mp3", "mp4", "wav", "webm", "woff", "woff2", "ttf", "otf",
                                  "map", "lock", "tgz", "gz", "bz2", "xz", "whl", "exe", "dll", "so", "dylib"})

    def _scan(self, text: str) -> list[Hit]:
        hits: list[Hit] = [("email", m.start(), m.end(), 1.0, "address") for m in self._PLAIN.finditer(text)
                           if m.group(1).lower() not in self._FILE_EXTENSIONS]
        hits += [("email", m.start(), m.end(), 0.9, "obfuscated") for m in self._OBFUSCATED.finditer(text)
                 if m.group(1).lower() not in self._FILE_EXTENSIONS]
        return hits


# whitespace is bounded so a keyword sits within the stream filter's CONTEXT before the digits
_PHONE_KEYWORDS = r"(?:phone|tel|telephone|mobile|cell|call(?:\s{1,3}me)?|text\s{1,3}me|whatsapp|fax|contact)"


class PhoneDetector(_PiiSpanDetector):
    """International numbers written with ``+``/``00`` and a country code, North
    American numbers with separators, and bare digit runs right after a phone
    keyword; 8-15 digits (ITU-T E.164)."""

    name = "phone"
    yields_to = ("credit_card", "iban", "national_id")
    alphabet = r"[\d\s().+\-]"
    tail = r"[+(\d][\d\s().+\-]*\Z"  # a number starts with a digit, "+" or "("
    max_len = 40  # 15 digits (E.164), a separator after each, "+" or "00", parentheses
    _INTL = re.compile(r"(?<![\w+])(?:\+|00)[1-9]\d{0,2}(?:[ .\-]?\(?\d{1,5}\)?){2,6}(?![\w])")
    _NANP = re.compile(
        r"(?<![\w+])(?:1[ .\-]?)?(?:\([2-9]\d{2}\)\s?|[2-9]\d{2}[ .\-])[2-9]\d{2}[ .\-]\d{4}(?![\w])"
    )
    _CONTEXT = re.compile(
        rf"\b{_PHONE_KEYWORDS}\b[\s:#.]{{0,8}}(?:no\.?|number|nr\.?|at|on)?[\s:#.]{{0,8}}(\(?\d[\d ().\-]{{6,18}}\d)(?![\w])",
        re.IGNORECASE,
    )

    def _scan(self, text: str) -> list[Hit]:
        hits: list[Hit] = []
        for m in self._INTL.finditer(text):
            digits = re.sub(r"\D", "", m.group())
            digits = digits[2:] if m.group().startswith("00") else digits
            if 8 <= len(digits) <= 15 and len(set(digits)) > 2:
                hits.append(("phone", m.start(), m.end(), 0.95, "international"))
        for m in self._NANP.finditer(text):
            hits.append(("phone", m.start(), m.end(), 0.9, "nanp"))
        for m in self._CONTEXT.finditer(text):
            digits = re.sub(r"\D", "", m.group(1))
            if 8 <= len(digits) <= 15 and len(set(digits)) > 2:
                hits.append(("phone", m.start(1), m.end(1), 0.8, "after keyword"))
        return hits


class CreditCardDetector(_PiiSpanDetector):
    """Payment card numbers: 13-19 digits with one consistent separator, a known
    issuer prefix (ISO/IEC 7812 IIN ranges) and a valid Luhn check digit."""

    name = "credit_card"
    alphabet = r"[\d .\-]"
    tail = r"\d[\d .\-]*\Z"
    max_len = 37  # 19 digits with a separator between each
    _CANDIDATE = re.compile(r"(?<![\d.\-])\d(?:[ .\-]?\d){12,18}(?![\d])")
    _IIN = re.compile(r"^(?:4|5[1-5]|2(?:2[2-9]|[3-6]\d|7[01]|720)|3[47]|3(?:0[0-5]|[68])|6(?:011|5|4[4-9]|22)|35|62|81)")

    def _scan(self, text: str) -> list[Hit]:
        hits: list[Hit] = []
        for m in self._CANDIDATE.finditer(text):
            raw = m.group()
            seps = set(re.sub(r"\d", "", raw))
            if len(seps) > 1:
                continue
            digits = re.sub(r"\D", "", raw)
            if len(set(digits)) > 1 and self._IIN.match(digits) and luhn_ok(digits):
                hits.append(("credit_card", m.start(), m.end(), 1.0, "luhn ok"))
        return hits


class IbanDetector(_PiiSpanDetector):
    """IBANs: a registered country code, its registry length and MOD 97-10 == 1;
    spaces or dashes between characters are allowed."""

    name = "iban"
    alphabet = r"[A-Za-z0-9 \-]"
    # prefixes of the IBAN shape: 2 letters, 2 digits, then alphanumerics
    tail = r"(?<![A-Za-z0-9])[A-Za-z](?:[A-Za-z](?:\d(?:\d(?:[ \-]?[A-Za-z0-9])*)?)?)?[ \-]?\Z"
    max_len = 70  # 34 characters (the longest IBAN) with a separator between each
    _START = re.compile(r"(?<![A-Za-z0-9])([A-Za-z]{2})(\d{2})")

    def _scan(self, text: str) -> list[Hit]:
        hits: list[Hit] = []
        for m in self._START.finditer(text):
            want = IBAN_LENGTHS.get(m.group(1).upper())
            if want is None:
                continue
            chars = [m.group(1), m.group(2)]
            count, i = 4, m.end()
            while count < want and i < len(text):
                if text[i].isalnum() and text[i].isascii():
                    chars.append(text[i])
                    count += 1
                    i += 1
                elif text[i] in " -" and i + 1 < len(text) and text[i + 1].isalnum():
                    i += 1
                else:
                    break
            if count == want and not (i < len(text) and text[i].isalnum()) and iban_ok("".join(chars)):
                hits.append(("iban", m.start(), i, 1.0, "mod97 ok"))
        return hits


class NationalIdDetector(_PiiSpanDetector):
    """National identifiers with their validity rules: US SSN (SSA area/group/serial
    rules), UK National Insurance number (HMRC prefix rules), Spanish DNI/NIE
    (mod-23 letter), Indian Aadhaar (Verhoeff check digit)."""

    name = "national_id"
    yields_to = ("credit_card", "iban")
    alphabet = r"[A-Za-z0-9 \-]"
    # prefixes of every kind: up to 2 letters, digits with separators, a final letter
    # (a digit may follow a letter: an Aadhaar number's look-behind only refuses digits and dashes)
    tail = r"(?:(?<![A-Za-z0-9])[A-Za-z]{1,2}|\d)[\d \-]*[A-Za-z]?\Z"
    max_len = 16
    KINDS = ("us_ssn", "uk_nino", "es_dni", "in_aadhaar")
    _SSN = re.compile(r"(?<![\d\-])(\d{3})([ \-])(\d{2})\2(\d{4})(?![\d\-])")
    _SSN_CONTEXT = re.compile(r"\b(?:ssn|social security(?: number| no\.?)?)\b\W{0,4}(\d{9})(?!\d)", re.IGNORECASE)
    _NINO = re.compile(
        r"(?<![A-Za-z0-9])([A-CEGHJ-PR-TW-Z][A-CEGHJ-NPR-TW-Z]) ?(\d{2}) ?(\d{2}) ?(\d{2}) ?([A-D])(?![A-Za-z0-9])"
    )
    _DNI = re.compile(r"(?<![A-Za-z0-9])([XYZ]?\d{7,8})[ \-]?([A-Za-z])(?![A-Za-z0-9])")
    # 12 digits, not a piece of a longer grouped number (a 16-digit card written 4-4-4-4)
    _AADHAAR = re.compile(r"(?<![\d\-])(?<!\d )([2-9]\d{3})([ \-]?)(\d{4})\2(\d{4})(?![\d\-])(?! \d)")

    def __init__(self, kinds: Iterable[str] | None = None) -> None:
        super().__init__()
        chosen = tuple(kinds) if kinds is not None else self.KINDS
        unknown = [k for k in chosen if k not in self.KINDS]
        if unknown:
            raise DetectorOptionError("kinds", "unknown national id kind", value=unknown[0],
                                      fix=f"choose from {', '.join(self.KINDS)}")
        self.kinds = frozenset(chosen)

    @staticmethod
    def _ssn_ok(area: str, group: str, serial: str) -> bool:
        return area not in ("000", "666") and area[0] != "9" and group != "00" and serial != "0000"

    def _scan(self, text: str) -> list[Hit]:
        hits: list[Hit] = []
        if "us_ssn" in self.kinds:
            for m in self._SSN.finditer(text):
                if self._ssn_ok(m.group(1), m.group(3), m.group(4)):
                    hits.append(("national_id", m.start(), m.end(), 0.9, "us_ssn"))
            for m in self._SSN_CONTEXT.finditer(text):
                d = m.group(1)
                if self._ssn_ok(d[:3], d[3:5], d[5:]):
                    hits.append(("national_id", m.start(1), m.end(1), 0.9, "us_ssn"))
        if "uk_nino" in self.kinds:
            for m in self._NINO.finditer(text.upper()):
                if m.group(1) not in ("BG", "GB", "NK", "KN", "TN", "NT", "ZZ"):
                    hits.append(("national_id", m.start(), m.end(), 0.95, "uk_nino"))
        if "es_dni" in self.kinds:
            for m in self._DNI.finditer(text):
                number = m.group(1)
                if (len(number) == 8 or number[0] in "XYZ") and dni_ok(number, m.group(2)):
                    hits.append(("national_id", m.start(), m.end(), 1.0, "es_dni"))
        if "in_aadhaar" in self.kinds:
            for m in self._AADHAAR.finditer(text):
                if verhoeff_ok(m.group(1) + m.group(3) + m.group(4)):
                    hits.append(("national_id", m.start(), m.end(), 0.9, "in_aadhaar"))
        return hits


class IpAddressDetector(_PiiSpanDetector):
    """IPv4 and IPv6 addresses that ``ipaddress`` parses; dotted runs with more
    than four parts (version strings) are not addresses."""

    name = "ip_address"
    alphabet = r"[0-9A-Fa-f.:%]"
    tail = r"(?<![\w.:])[0-9A-Fa-f:][0-9A-Fa-f.:%]*\Z"
    max_len = 64  # 45 for an IPv4-mapped IPv6 address, plus a zone id
    _V4 = re.compile(r"(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?!\.?\d|\w)")
    _V6 = re.compile(r"(?<![\w:.])(?:[0-9A-Fa-f]{0,4}:){2,7}(?:[0-9A-Fa-f]{1,4}|(?:\d{1,3}\.){3}\d{1,3})?(?![\w:])")

    def __init__(self, versions: Iterable[int] = (4, 6), include_private: bool = True) -> None:
        super().__init__()
        self.versions = frozenset(versions)
        if not self.versions or not self.versions <= {4, 6}:
            raise DetectorOptionError("versions", "IP versions must be a subset of [4, 6]", value=list(versions))
        self.include_private = include_private

    def _keep(self, addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
        return self.include_private or addr.is_global

    def _scan(self, text: str) -> list[Hit]:
        hits: list[Hit] = []
        if 4 in self.versions:
            for m in self._V4.finditer(text):
                try:
                    addr4 = ipaddress.IPv4Address(m.group())
                except ValueError:
                    continue
                if self._keep(addr4):
                    hits.append(("ip_address", m.start(), m.end(), 1.0, "ipv4"))
        if 6 in self.versions:
            for m in self._V6.finditer(text):
                if m.group().count(":") < 2 or m.group() == "::":
                    continue
                try:
                    addr6 = ipaddress.IPv6Address(m.group())
                except ValueError:
                    continue
                if self._keep(addr6):
                    hits.append(("ip_address", m.start(), m.end(), 1.0, "ipv6"))
        return hits


def _secrets_detector() -> SpanDetector:
    from plyx.safety._secrets import SecretsDetector

    return SecretsDetector()


PII_ENTITIES = {
    "email": EmailDetector,
    "phone": PhoneDetector,
    "credit_card": CreditCardDetector,
    "iban": IbanDetector,
    "national_id": NationalIdDetector,
    "ip_address": IpAddressDetector,
    "secrets": _secrets_detector,
}


class PiiDetector:
    """Every PII entity (or the chosen ``entities``) in one detector; findings keep
    each entity's label."""

    name = "pii"
    scope = "span"

    def __init__(self, entities: Iterable[str] | None = None) -> None:
        chosen = list(entities) if entities is not None else list(PII_ENTITIES)
        for entity in chosen:
            if entity not in PII_ENTITIES:
                raise DetectorOptionError("entities", "unknown PII entity", value=entity,
                                          fix=f"choose from {', '.join(PII_ENTITIES)}")
        self.parts = [PII_ENTITIES[e]() for e in chosen]
        # a part whose higher entities are all parts too need not ask them again: the overlap
        # resolution below gives way to them, and pending() already holds what they hold
        self._detects = [p.detect_own if set(getattr(p, "yields_to", ())) <= set(chosen) and hasattr(p, "detect_own")
                         else p.detect for p in self.parts]
        self._pendings = [p.pending_own if set(getattr(p, "yields_to", ())) <= set(chosen) and hasattr(p, "pending_own")
                          else p.pending for p in self.parts]

    def detect(self, text: str, context: Mapping[str, Any] | None = None) -> list[Finding]:
        found = [f for detect in self._detects for f in detect(text, context)]
        # one span, one entity: the entity of higher PRIORITY wins (a card over the
        # Aadhaar number its first digits pass for), then the longest, then the first
        rank = {name: i for i, name in enumerate(PRIORITY)}
        found.sort(key=lambda f: (rank.get(f.detector, len(rank)), f.start - f.end, f.start))
        kept: list[Finding] = []
        for f in found:
            if all(f.end <= k.start or f.start >= k.end for k in kept):
                kept.append(f)
        kept.sort(key=lambda f: f.start)
        return [Finding(self.name, f.label, f.start, f.end, f.score, f.detail) for f in kept]

    def pending(self, text: str) -> int:
        return min((pending(text) for pending in self._pendings), default=len(text))
