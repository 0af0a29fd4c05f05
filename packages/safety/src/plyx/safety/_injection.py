"""Prompt-injection and jailbreak heuristics.

A weighted set of phrase patterns, each a known attack move (instruction
override, persona switch, "no restrictions", system-prompt extraction, chat
template smuggling, fictional/hypothetical framing...). The score of a text is
``1 - prod(1 - w)`` over the distinct moves found, so one strong move (an
override) or several weak ones (a role-play frame plus "no rules") cross the
threshold, while one weak cue ("how do I jailbreak my phone") does not.

Payloads hidden by encoding are decoded (base64, hex, ROT13, leetspeak,
letter spacing; see ``_decoders``) and rescanned, up to ``max_depth`` layers.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from plyx.safety._decoders import decode_all
from plyx.safety._normalize import normalize
from plyx.safety._types import DetectorOptionError, Finding

__all__ = ["PromptInjectionDetector", "MOVES"]

_W = r"(?:\W+\w+){0,4}?\W+"  # up to four filler words between cue words
_OBJ = r"(?:instructions?|prompts?|rules|directions|guidelines|guardrails|constraints|directives|programming|polic(?:y|ies)|commands?|system\s+prompt)"

# (move, weight, pattern) on normalised (case-folded, homoglyph-free) text
MOVES: list[tuple[str, float, str]] = [
    ("override", 0.9,
     rf"\b(?:ignore|disregard|forget|skip|bypass|override|abandon|drop|neglect)\b{_W}"
     rf"(?:previous|prior|above|earlier|preceding|all|any|your|the|these|those|system|original|initial)\b{_W}?{_OBJ}"),
    ("override", 0.9, r"\b(?:ignore|disregard|forget)\s+(?:everything|all)\s+(?:above|before|previously|you\s+were\s+told)"),
    ("override", 0.7, rf"\b(?:do\s+not|don't|dont|stop)\s+(?:follow|obey)(?:ing)?\b{_W}?{_OBJ}"),
    ("new_instructions", 0.6, r"\b(?:new|updated|real|actual|true|revised)\s+(?:instructions?|task|objective|system\s+prompt|rules)\s*[:\-]"),
    ("persona", 0.45, r"\byou\s+are\s+(?:now|no\s+longer)\b"),
    ("persona", 0.9,
     r"\b(?:act|behave|respond|answer|roleplay|role-play|pretend)\s+(?:as|like|to\s+be|(?:that\s+)?you\s+are)\s+"
     r"(?:if\s+you\s+(?:were|are)\s+)?(?:an?\s+)?"
     r"(?:unfiltered|unrestricted|uncensored|evil|jailbroken|amoral|unethical|rogue|unaligned)"),
    ("persona", 0.35, r"\bpretend\s+(?:that\s+)?(?:you\s+are|to\s+be|you're|youre)\b"),
    ("persona", 0.3, r"\b(?:from\s+now\s+on|henceforth|for\s+the\s+rest\s+of\s+this\s+conversation)\b"),
    ("roleplay", 0.3, r"\b(?:role-?play|let's\s+play\s+a\s+game|stay\s+in\s+character|never\s+break\s+character)\b"),
    ("jailbreak_name", 0.8, r"\b(?:dan|do\s+anything\s+now)\b.{0,80}\b(?:mode|prompt|jailbreak|can|will|must|now)\b"),
    ("jailbreak_name", 0.4, r"\b(?:jailbreak|jailbroken|developer\s+mode|god\s+mode|evil\s+confidant|anti-?dan)\b"),
    ("no_limits", 0.6,
     r"\b(?:without|no|free\s+(?:of|from)|ignore|bypass|free\s+of\s+all)\s+(?:any\s+|all\s+|your\s+)?"
     r"(?:restrictions|filters?|filtering|censorship|limitations|ethical\s+(?:guidelines|constraints|boundaries)"
     r"|moral\s+(?:guidelines|constraints|boundaries)|safety\s+(?:guidelines|rules|filters|measures))"),
    ("no_limits", 0.8,
     r"\b(?:pretend|imagine|assume|act\s+as\s+if|suppose)\b.{0,40}?\b(?:you\s+(?:have|had|'ve)|there\s+(?:is|are|were)"
     r"|you\s+are\s+(?:free\s+of|without))\s+(?:no|zero)\s+(?:content\s+|safety\s+|usage\s+)?"
     r"(?:polic(?:y|ies)|filters?|restrictions|guidelines|rules|limits|safeguards|guardrails)"),
    ("no_limits", 0.5,
     r"\byou\s+(?:have|'ve)\s+no\s+(?:content\s+|safety\s+)?(?:polic(?:y|ies)|filters?|restrictions|guidelines)\b"),
    ("extraction", 0.8,
     r"\b(?:reveal|show|print|repeat|output|display|leak|dump|recite|tell\s+me|what\s+(?:is|are|were))\b.{0,30}"
     r"\byour\s+(?:system\s+prompt|initial\s+(?:prompt|instructions)|hidden\s+(?:prompt|instructions)"
     r"|original\s+(?:prompt|instructions)|instructions|prompt|rules)\b"),
    ("extraction", 0.7, r"\b(?:repeat|print|output)\s+(?:the\s+)?(?:text|words|everything|instructions)\s+(?:above|before\s+this)\b"),
    # chat-template control tokens in user text (ChatML, Llama 2/3, Gemma, Phi, Mistral). Matched on text
    # whose "_" became " " (see _moves_in): `im[ _]start`
    ("template", 0.7,
     r"<\|im[ _](?:start|end|sep)\|>|<\|(?:system|user|assistant|endoftext|eot[ _]id|end)\|>|\[/?inst\]|<</?sys>>"
     r"|<\|(?:start|end)[ _]header[ _]id\|>|<(?:start|end)[ _]of[ _]turn>"),
    # a smuggled system turn: the control token followed by a system role
    ("template_system", 0.9,
     r"(?:<\|im[ _]start\|>|<\|start[ _]header[ _]id\|>|<start[ _]of[ _]turn>)\s*system\b|<\|system\|>|<<sys>>"),
    ("template", 0.4, r"(?:^|\n)\s*#{2,}\s*(?:system|instruction|new\s+instructions?)\b|(?:^|\n)\s*system\s*:"),
    ("framing", 0.4,
     r"\b(?:hypothetically|in\s+a\s+fictional\s+(?:world|story|universe)|for\s+a\s+(?:novel|story|movie|screenplay))\b"
     r".{0,120}\b(?:how\s+to|step[-\s]by[-\s]step|detailed\s+instructions|exact\s+(?:steps|recipe))"),
    ("framing", 0.5, r"\bmy\s+(?:late|dead|deceased)\s+grand(?:ma|mother|father|pa)\b.{0,160}\b(?:used\s+to|would)\b"),
    ("dual_answer", 0.5, r"\b(?:answer|respond|reply)\s+(?:twice|in\s+two\s+ways|as\s+both)\b"),
    ("encoded_instruction", 0.3, r"\b(?:decode|base64|rot13|hex)\b.{0,60}\b(?:and\s+(?:then\s+)?(?:follow|execute|do|obey|answer))\b"),
]


_NEGATED = re.compile(r"\b(?:never|not|don't|dont|do\s+not|must\s+not|mustn't|cannot|can't|won't|refuse\s+to)\s+\Z")


class PromptInjectionDetector:
    """Scores a text for prompt-injection and jailbreak moves, decoding hidden payloads.

    Args:
        threshold: the combined score at which the text is flagged (0..1).
        decode: decode base64/hex/ROT13/leetspeak/spaced payloads and rescan them.
        max_depth: how many nested encodings to peel (base64 inside hex...).
    """

    name = "prompt_injection"
    scope = "text"

    def __init__(self, threshold: float = 0.5, decode: bool = True, max_depth: int = 2) -> None:
        if not 0 < float(threshold) <= 1:
            raise DetectorOptionError("threshold", "must be in (0, 1]", value=threshold)
        if int(max_depth) < 0:
            raise DetectorOptionError("max_depth", "must be >= 0", value=max_depth)
        self.threshold = float(threshold)
        self.decode = bool(decode)
        self.max_depth = int(max_depth)
        self._moves = [(name, w, re.compile(p, re.S)) for name, w, p in MOVES]

    def _moves_in(self, text: str) -> dict[str, tuple[float, int, int]]:
        """move -> (weight, start, end) of its strongest cue, on raw offsets."""
        norm = normalize(text)
        # "ignore_all_previous_instructions": underscores separate words too (same length: offsets hold)
        subject = norm.text.replace("_", " ")
        found: dict[str, tuple[float, int, int]] = {}
        for name, weight, rx in self._moves:
            # "never reveal your system prompt" is a system prompt defending itself, not an attack
            m = next((m for m in rx.finditer(subject) if not _NEGATED.search(subject, max(0, m.start() - 24), m.start())),
                     None)
            if m and weight > found.get(name, (0.0, 0, 0))[0]:
                found[name] = (weight, *norm.span(m.start(), m.end()))
        return found

    def score(self, text: str) -> tuple[float, list[tuple[str, int, int, str]]]:
        """(score, cues): cues are ``(move, start, end, via)``, ``via`` the decoders peeled."""
        cues: dict[str, tuple[float, int, int, str]] = {}
        layers: list[tuple[str, int, int, str]] = [(text, 0, len(text), "")]
        for depth in range(self.max_depth + 1):
            nxt: list[tuple[str, int, int, str]] = []
            for layer, s, e, via in layers:
                for move, (w, ms, me) in self._moves_in(layer).items():
                    span = (ms, me) if not via else (s, e)
                    if w > cues.get(move, (0.0,))[0]:
                        cues[move] = (w, *span, via)
                if self.decode and depth < self.max_depth:
                    for decoder, ds, de, decoded in decode_all(layer):
                        # offsets of a decoded layer point at its encoded form in the original
                        outer = (ds, de) if not via else (s, e)
                        nxt.append((decoded, *outer, f"{via}+{decoder}" if via else decoder))
            layers = nxt
            if not layers:
                break
        remaining = 1.0
        for w, *_ in cues.values():
            remaining *= 1 - w
        return 1 - remaining, [(move, s, e, via) for move, (w, s, e, via) in cues.items()]

    def detect(self, text: str, context: Mapping[str, Any] | None = None) -> list[Finding]:
        score, cues = self.score(text)
        if score < self.threshold:
            return []
        return [
            Finding(self.name, f"injection:{move}", s, e, round(score, 3), f"via {via}" if via else "plain")
            for move, s, e, via in sorted(cues, key=lambda c: c[1])
        ]
