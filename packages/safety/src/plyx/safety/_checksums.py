"""Check digits that separate real identifiers from look-alike digit runs."""

from __future__ import annotations

__all__ = ["luhn_ok", "iban_ok", "IBAN_LENGTHS", "verhoeff_ok", "dni_ok"]


def luhn_ok(digits: str) -> bool:
    """ISO/IEC 7812 Luhn check (payment cards, Canadian SIN).

    Double every second digit from the right, subtract 9 from results above 9,
    and the sum must be a multiple of 10.
    """
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2:
            d *= 2
            if d > 9:
                d -= 9
        total += d
    return total % 10 == 0


# ISO 13616 registry: country code -> IBAN length (SWIFT IBAN registry, 2024).
IBAN_LENGTHS = {
    "AD": 24, "AE": 23, "AL": 28, "AT": 20, "AZ": 28, "BA": 20, "BE": 16, "BG": 22, "BH": 22, "BR": 29,
    "BY": 28, "CH": 21, "CR": 22, "CY": 28, "CZ": 24, "DE": 22, "DK": 18, "DO": 28, "EE": 20, "EG": 29,
    "ES": 24, "FI": 18, "FO": 18, "FR": 27, "GB": 22, "GE": 22, "GI": 23, "GL": 18, "GR": 27, "GT": 28,
    "HR": 21, "HU": 28, "IE": 22, "IL": 23, "IQ": 23, "IS": 26, "IT": 27, "JO": 30, "KW": 30, "KZ": 20,
    "LB": 28, "LC": 32, "LI": 21, "LT": 20, "LU": 20, "LV": 21, "MC": 27, "MD": 24, "ME": 22, "MK": 19,
    "MR": 27, "MT": 31, "MU": 30, "NL": 18, "NO": 15, "PK": 24, "PL": 28, "PS": 29, "PT": 25, "QA": 29,
    "RO": 24, "RS": 22, "SA": 24, "SC": 31, "SE": 24, "SI": 19, "SK": 24, "SM": 27, "ST": 25, "SV": 28,
    "TL": 23, "TN": 24, "TR": 26, "UA": 29, "VA": 22, "VG": 24, "XK": 20,
}


def iban_ok(iban: str) -> bool:
    """ISO 13616 / ISO 7064 MOD 97-10: move the first four characters to the end,
    turn letters into 10..35, and the number mod 97 must be 1."""
    iban = iban.upper()
    if IBAN_LENGTHS.get(iban[:2]) != len(iban) or not iban[2:4].isdigit() or not iban.isalnum():
        return False
    rearranged = iban[4:] + iban[:4]
    number = "".join(str(int(ch, 36)) for ch in rearranged)
    return int(number) % 97 == 1


# Verhoeff's dihedral-group tables (used by India's Aadhaar numbers).
_D = [
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 0, 6, 7, 8, 9, 5], [2, 3, 4, 0, 1, 7, 8, 9, 5, 6],
    [3, 4, 0, 1, 2, 8, 9, 5, 6, 7], [4, 0, 1, 2, 3, 9, 5, 6, 7, 8], [5, 9, 8, 7, 6, 0, 4, 3, 2, 1],
    [6, 5, 9, 8, 7, 1, 0, 4, 3, 2], [7, 6, 5, 9, 8, 2, 1, 0, 4, 3], [8, 7, 6, 5, 9, 3, 2, 1, 0, 4],
    [9, 8, 7, 6, 5, 4, 3, 2, 1, 0],
]
_P = [
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 5, 7, 6, 2, 8, 3, 0, 9, 4], [5, 8, 0, 3, 7, 9, 6, 1, 4, 2],
    [8, 9, 1, 6, 0, 4, 3, 5, 2, 7], [9, 4, 5, 3, 1, 2, 6, 8, 7, 0], [4, 2, 8, 6, 5, 7, 3, 9, 0, 1],
    [2, 7, 9, 3, 8, 0, 6, 4, 1, 5], [7, 0, 4, 6, 9, 1, 3, 2, 5, 8],
]


def verhoeff_ok(digits: str) -> bool:
    """Verhoeff check: catches every single-digit error and adjacent transposition."""
    c = 0
    for i, ch in enumerate(reversed(digits)):
        c = _D[c][_P[i % 8][ord(ch) - 48]]
    return c == 0


_DNI_LETTERS = "TRWAGMYFPDXBNJZSQVHLCKE"


def dni_ok(number: str, letter: str) -> bool:
    """Spanish DNI/NIE: the letter is ``TRWAGMYFPDXBNJZSQVHLCKE[n mod 23]``;
    an NIE's leading X/Y/Z counts as 0/1/2."""
    lead = {"X": "0", "Y": "1", "Z": "2"}
    digits = lead.get(number[0].upper(), number[0]) + number[1:]
    return digits.isdigit() and _DNI_LETTERS[int(digits) % 23] == letter.upper()
