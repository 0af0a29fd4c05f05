from __future__ import annotations

import random

from plyx.safety import normalize
from plyx.safety._normalize import HOMOGLYPHS, ZERO_WIDTH


def test_zero_width_homoglyph_fullwidth_and_case_fold_to_ascii():
    text = "Ｋі\u200bLL\u00ad yоu"  # fullwidth K, Cyrillic i and o, zero-width space, soft hyphen
    n = normalize(text)
    assert n.text == "kill you"


def test_offsets_point_back_at_the_original_characters():
    text = "ab\u200bcé\u200dx"
    n = normalize(text)
    assert n.text == "abcex"
    # "cex" in the normalised text covers "cé\u200dx" in the original (zero-width inside kept)
    s, e = n.span(2, 5)
    assert text[s:e] == "cé\u200dx"
    assert n.offset(len(n.text)) == len(text)


def test_ascii_fast_path_is_an_identity_map():
    n = normalize("Hello World", fold_case=False)
    assert n.text == "Hello World"
    assert n.span(6, 11) == (6, 11)


def test_random_obfuscation_of_words_normalises_back():
    rng = random.Random(7)
    invisible = sorted(ZERO_WIDTH)
    latin_for = {v: k for k, v in HOMOGLYPHS.items() if len(v) == 1 and v.islower()}
    for _ in range(200):
        word = "".join(rng.choice("abcdeghikmnoprstuwxy") for _ in range(rng.randint(3, 10)))
        obf = []
        for ch in word:
            if ch in latin_for and rng.random() < 0.4:
                ch = latin_for[ch]  # a lookalike of another script (its capital may look different)
            elif rng.random() < 0.3:
                ch = ch.upper()
            obf.append(ch)
            if rng.random() < 0.3:
                obf.append(chr(rng.choice(invisible)))
        n = normalize("".join(obf))
        assert n.text == word, ("".join(obf), n.text)
        s, e = n.span(0, len(n.text))
        assert "".join(obf)[s:e].strip(''.join(map(chr, invisible))) == "".join(obf).strip(''.join(map(chr, invisible)))
