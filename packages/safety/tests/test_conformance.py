"""Every detector the registry discovers keeps the contract, streaming promise included."""

from __future__ import annotations

import pytest
from plyx.safety import available_detectors, build_detector
from plyx.safety._evaluate import EVAL_CONFIG, load_evalset
from plyx.safety.testing import DetectorContractError, check_detector
from plyx.specs import plugins

EXTRA = {"deny_list": {"deny": ["idiot", "kill yourself"]}, "regex": {"patterns": [r"[A-Z]{3}-\d{3,}"]},
         "length": {"max_chars": 40}, "classifier": {"model": lambda text: float("bad" in text)}}
SAMPLES = ["mail jane.doe@example.com or +1 415 555 0132 now", "card 4111 1111 1111 1111, iban DE89 3704 0044 0532 0130 00.",
           "ssn 123-45-6789 at 192.168.1.10 key AKIAIOSFODNN7EXAMPLE", "you 1d10t, kill yourself ABC-1234",
           "bob [at] example [dot] org", "nothing to see here", "4 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 ok",
           "password = 'Tr0ub4dor&3xY!9q' done"]


def discovered() -> list[str]:
    # collection runs before conftest's per-test restriction: do not import every plane here
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PLYX_PLUGINS", "safety")
        plugins.reset_plugins()
        names = sorted(available_detectors())
    plugins.reset_plugins()
    return names


# rate_limit counts calls, so its answer depends on the caller's window rather than on the
# text alone; its behaviour is tested in test_detectors instead of by the text-only kit.
@pytest.mark.parametrize("name", [n for n in discovered() if n != "rate_limit"])
def test_discovered_detectors_keep_the_contract(name):
    detector = build_detector(name, {**EVAL_CONFIG.get(name, {}), **EXTRA.get(name, {})})
    own = [r["text"] for r in load_evalset() if r["detector"] == name and len(r["text"]) < 90][:12]
    check_detector(detector, SAMPLES + own)


def test_the_check_catches_a_detector_that_releases_too_early():
    from plyx.safety import Finding

    class Greedy:
        name, scope = "greedy", "span"

        def detect(self, text, context):
            i = text.find("secret")
            return [Finding("greedy", "x", i, i + 6)] if i >= 0 else []

        def pending(self, text):
            return len(text)  # claims nothing could still match: wrong for "sec"

    with pytest.raises(DetectorContractError, match="pending\\(\\) must hold back"):
        check_detector(Greedy(), ["my secret"])
    with pytest.raises(DetectorContractError, match="outside the text"):
        check_detector(type("Bad", (), {"name": "bad", "scope": "text",
                                        "detect": lambda self, t, c: [Finding("bad", "x", 0, len(t) + 1)]})(), ["a"])
