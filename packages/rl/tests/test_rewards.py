"""The built-in reward functions (through the plugin lookup, as a run builds them) and fault-isolating scoring."""

from __future__ import annotations

import math

import pytest
from plyx.rl import RewardError, RewardSpec, build_rewards, reward_components, score_completions


def _fn(name, **args):
    [(_, _, fn)] = build_rewards([RewardSpec(name=name, args=args)])
    return fn


def test_builtins_are_plugin_components_of_plyx_rl():
    found = reward_components()
    for name in ("exact_match", "numeric_match", "regex_format", "length_penalty", "reward_model"):
        assert found[name].source.startswith("plyx-rl"), name


def test_exact_and_numeric_match():
    exact = _fn("exact_match")
    assert exact(["p"] * 4, [" 81\n", "18", "81", "x"], answer=["81", "81", None, "x"]) == [1.0, 0.0, None, 1.0]
    assert _fn("exact_match", strip=False)(["p"], [" 81"], answer=["81"]) == [0.0]
    num = _fn("numeric_match", tolerance=0.01)
    assert num(["p"] * 4, ["so 3.005", "2 then 4", "none", "7"], answer=["3", "4", "1", "seven"]) == [1.0, 1.0, 0.0,
                                                                                                       None]
    with pytest.raises(ValueError, match="needs the column .answer."):
        exact(["p"], ["1"], label=["1"])


def test_regex_format_and_length_penalty():
    fmt = _fn("regex_format", pattern=r"\d+( \d+)*", reward=1.0, penalty=-0.5)
    assert fmt(["p"] * 3, ["1 2 5", " 7 ", "1, 2"]) == [1.0, 1.0, -0.5]
    assert _fn("regex_format", pattern="ok", mode="search")(["p"] * 2, ["is ok?", "no"]) == [1.0, 0.0]
    pen = _fn("length_penalty", max_length=10, cache=4)
    ids = [[0] * n for n in (3, 6, 8, 10, 12)]
    assert pen(["p"] * 5, [""] * 5, completion_ids=ids) == [0.0, 0.0, -0.5, -1.0, -1.0]  # DAPO eq. 13
    assert _fn("length_penalty", max_length=4, cache=2, unit="chars")(["p"] * 2, ["ab", "abcde"]) == [0.0, -1.0]
    with pytest.raises(ValueError, match="cache < max_length"):
        _fn("length_penalty", max_length=4, cache=4)
    with pytest.raises(ValueError, match="rewards\\[0\\] \\(exact_match\\): bad args"):
        _fn("exact_match", pattern="x")


def test_scoring_isolates_failing_samples_and_sums_weights():
    def flaky(prompts, completions, **c):
        if "boom" in completions:
            raise RuntimeError("boom")
        return [None if comp == "skip" else 1.0 for comp in completions]

    rewards = [("flaky", 2.0, flaky), ("half", 0.5, lambda p, c, **k: [0.5] * len(c))]
    out = score_completions(rewards, ["p"] * 3, ["a", "boom", "skip"], {})
    assert out.errors == {"flaky": 1} and out.skipped == {"flaky": 1, "half": 0}
    assert out.per_function["flaky"][0] == 1.0 and math.isnan(out.per_function["flaky"][1])
    assert out.total == [2.0 + 0.25, 0.25, 0.25]  # a sample scored by one function keeps that one's reward
    assert out.first_error == "flaky: RuntimeError: boom"
    with pytest.raises(RewardError, match="'flaky' raised RuntimeError: boom"):
        score_completions(rewards, ["p"] * 2, ["a", "boom"], {}, strict=True)
    with pytest.raises(RewardError, match="returned list of length 1 for 2 completions"):
        score_completions([("short", 1.0, lambda p, c, **k: [1.0])], ["p"] * 2, ["a", "b"], {})
    none = score_completions([("none", 1.0, lambda p, c, **k: [None] * len(c))], ["p"], ["a"], {})
    assert math.isnan(none.total[0])  # no function scored it: NaN, advantage 0 downstream
