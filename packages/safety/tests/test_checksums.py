from __future__ import annotations

import random

from plyx.safety._checksums import dni_ok, iban_ok, luhn_ok, verhoeff_ok


def _luhn_complete(body: str) -> str:
    for d in "0123456789":
        if luhn_ok(body + d):
            return body + d
    raise AssertionError("a Luhn check digit always exists")


def test_known_values():
    assert luhn_ok("4111111111111111") and not luhn_ok("4111111111111112")
    assert luhn_ok("378282246310005")
    assert iban_ok("GB82WEST12345698765432") and iban_ok("FR1420041010050500013M02606")
    assert not iban_ok("GB82WEST12345698765431") and not iban_ok("GB82WEST1234569876543")  # digit, length
    assert verhoeff_ok("2363") and not verhoeff_ok("2364")  # Verhoeff's own example
    assert dni_ok("12345678", "Z") and dni_ok("X1234567", "L") and not dni_ok("12345678", "A")


def test_luhn_catches_every_single_digit_error():
    rng = random.Random(0)
    for _ in range(300):
        number = _luhn_complete("".join(rng.choice("0123456789") for _ in range(rng.randint(12, 18))))
        i = rng.randrange(len(number))
        wrong = str((int(number[i]) + rng.randint(1, 9)) % 10)
        assert not luhn_ok(number[:i] + wrong + number[i + 1:])


def test_iban_catches_swapped_adjacent_characters():
    rng = random.Random(1)
    iban = "DE89370400440532013000"
    for _ in range(50):
        i = rng.randrange(4, len(iban) - 1)
        if iban[i] != iban[i + 1]:
            swapped = iban[:i] + iban[i + 1] + iban[i] + iban[i + 2:]
            assert not iban_ok(swapped)


def test_verhoeff_catches_every_adjacent_transposition():
    rng = random.Random(2)
    for _ in range(200):
        body = "".join(rng.choice("0123456789") for _ in range(11))
        full = next(body + d for d in "0123456789" if verhoeff_ok(body + d))
        i = rng.randrange(len(full) - 1)
        if full[i] != full[i + 1]:
            assert not verhoeff_ok(full[:i] + full[i + 1] + full[i] + full[i + 2:])
