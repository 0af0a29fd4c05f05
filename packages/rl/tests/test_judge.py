"""Pairwise-judge aggregation: Bradley-Terry recovers a known ordering, bootstrap intervals cover the truth, ties
are half-wins, the position-bias check finds an injected bias, the OpenAI-API collection path (a fake HTTP judge
through the real ``openai`` client), the command, and bad verdict files."""

from __future__ import annotations

import json
import math
import random
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from plyx.rl import DataError
from plyx.rl._judge import (
    Verdict,
    collect_verdicts,
    fit_bradley_terry,
    judge_prompt,
    parse_verdict,
    position_bias,
    rank_models,
    read_verdicts,
)

TRUE = {"m0": -1.2, "m1": -0.4, "m2": 0.0, "m3": 0.5, "m4": 1.1}  # centred: mean 0


def _synthetic(n_questions: int, seed: int, *, bias: float = 0.0, tie: float = 0.0) -> list[Verdict]:
    """Every pair of models on each question, judged in both orders by a Bradley-Terry judge.

    With probability ``bias`` the judge just picks the answer shown first; with ``tie`` it calls a tie.
    """
    rng = random.Random(seed)
    out = []
    for q in range(n_questions):
        for a, b in [(a, b) for a in TRUE for b in TRUE if a != b]:
            if rng.random() < bias:
                w = "a"
            elif rng.random() < tie:
                w = "tie"
            else:
                w = "a" if rng.random() < 1 / (1 + math.exp(-(TRUE[a] - TRUE[b]))) else "b"
            out.append(Verdict(a, b, w, key=str(q)))
    return out


def test_recovers_the_strength_ordering_and_values():
    ranking = rank_models(_synthetic(100, seed=1), bootstrap=50, seed=0)
    assert [r["model"] for r in ranking.rows] == ["m4", "m3", "m2", "m1", "m0"]
    for r in ranking.rows:  # 800 games per model: a standard error of about 0.08
        assert r["theta"] == pytest.approx(TRUE[r["model"]], abs=0.2)
        assert r["elo"] == pytest.approx(1000 + 400 / math.log(10) * r["theta"])
        assert r["theta_ci"][0] < r["theta"] < r["theta_ci"][1]
        assert r["games"] == 100 * 8 and r["wins"] + r["losses"] + r["ties"] == r["games"]


def test_bootstrap_intervals_cover_the_truth():
    """Over 8 synthetic data sets x 5 models, 95% intervals should cover the true strength ~95% of the time."""
    covered = total = 0
    for seed in range(8):
        ranking = rank_models(_synthetic(15, seed=100 + seed), bootstrap=100, seed=seed)
        for r in ranking.rows:
            total += 1
            covered += r["theta_ci"][0] <= TRUE[r["model"]] <= r["theta_ci"][1]
    assert covered / total >= 0.85, (covered, total)


def test_ties_are_half_wins():
    # A beat B once and tied once: W_AB = 1.5, W_BA = 0.5, so theta_A - theta_B = log(1.5 / 0.5) = log 3
    W = torch.tensor([[0.0, 1.5], [0.5, 0.0]], dtype=torch.float64)
    theta = fit_bradley_terry(W, prior=0.0)
    assert float(theta[0] - theta[1]) == pytest.approx(math.log(3), rel=1e-9)
    verdicts = [Verdict("A", "B", "a"), Verdict("B", "A", "tie")]
    ranking = rank_models(verdicts, bootstrap=0, prior=0.0)
    assert ranking.rows[0]["model"] == "A"
    assert ranking.rows[0]["theta"] - ranking.rows[1]["theta"] == pytest.approx(math.log(3), rel=1e-9)
    assert ranking.rows[0]["ties"] == ranking.rows[1]["ties"] == 1
    # a model that wins everything stays finite with the prior
    sweep = rank_models([Verdict("A", "B", "a")] * 5, bootstrap=0, prior=0.1)
    assert math.isfinite(sweep.rows[0]["theta"]) and sweep.rows[0]["theta"] > 1


def test_position_bias_check_detects_injected_bias():
    fair = position_bias(_synthetic(30, seed=3))
    biased = position_bias(_synthetic(30, seed=3, bias=0.3))
    assert not fair["biased"] and fair["first_position_win_rate_ci95"][0] <= 0.5
    assert biased["biased"] and biased["first_position_win_rate"] > 0.6
    assert fair["pairs_judged_both_orders"] == biased["pairs_judged_both_orders"] == 30 * 10
    assert biased["flip_rate"] > fair["flip_rate"] + 0.1
    # a judge that always picks the first answer flips on every comparison
    always = position_bias(_synthetic(3, seed=4, bias=1.0))
    assert always["first_position_win_rate"] == 1.0 and always["flip_rate"] == 1.0
    # the ranking survives a moderate bias because every pair is judged in both orders
    assert [r["model"] for r in rank_models(_synthetic(40, seed=1, bias=0.3), bootstrap=0).rows][0] == "m4"


def test_read_verdicts_and_bad_files(tmp_path):
    good = tmp_path / "v.jsonl"
    good.write_text("\n".join(json.dumps(r) for r in [
        {"model_a": "x", "model_b": "y", "winner": "model_a", "question_id": 1},
        {"model_a": "y", "model_b": "x", "winner": "x", "question_id": 1},
        {"model_a": "x", "model_b": "z", "winner": "tie (bothbad)"},
        {"model_a": "z", "model_b": "y", "winner": "B"}]) + "\n")
    vs = read_verdicts(good)
    assert [v.winner for v in vs] == ["a", "b", "tie", "b"]
    assert position_bias(vs)["pairs_judged_both_orders"] == 1 and position_bias(vs)["flips"] == 0
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match="no verdicts \\(the file is empty\\)"):
        read_verdicts(empty)
    with pytest.raises(DataError, match="model 'z' is not among the models to rank \\(x, y\\); add it to --models"):
        read_verdicts(good, models=["x", "y"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"model_a": "x", "model_b": "y", "winner": "w"}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:1: winner 'w' names neither model .*model_a 'x', model_b 'y'"):
        read_verdicts(bad)
    bad.write_text(json.dumps({"model_a": "x", "winner": "x"}) + "\n")
    with pytest.raises(DataError, match="needs a non-empty string 'model_b'"):
        read_verdicts(bad)


def test_parse_verdict_and_prompt():
    assert parse_verdict("A is better. [[A]]") == "a"
    assert parse_verdict("first [[B]] then, on reflection, [[ C ]]") == "tie"  # the last verdict counts
    assert parse_verdict("no idea") is None and parse_verdict("") is None
    prompt = judge_prompt("2+2?", "4", "5")
    assert "[The Start of Assistant A's Answer]\n4\n" in prompt and "[The Start of Assistant B's Answer]\n5\n" in prompt


class _FakeJudge(BaseHTTPRequestHandler):
    """An OpenAI chat-completions endpoint: prefers the answer with the larger 'quality N', but says [[A]] for
    questions whose id is even when the answers are shown one way round (an injected position bias); question 3
    gets an unparsable reply."""

    def do_POST(self):  # http.server calls do_<METHOD>
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        user = body["messages"][-1]["content"]
        a = re.search(r"Assistant A's Answer\]\n(.*)\n\[The End of Assistant A", user, re.S).group(1)
        b = re.search(r"Assistant B's Answer\]\n(.*)\n\[The End of Assistant B", user, re.S).group(1)
        question = int(re.search(r"question (\d+)", user).group(1))
        qa, qb = (int(re.search(r"quality (\d+)", t).group(1)) for t in (a, b))
        if question == 3:
            text = "I cannot decide."
        elif question % 2 == 0:
            text = "The first one. [[A]]"
        else:
            text = "Explanation. " + ("[[A]]" if qa > qb else "[[B]]" if qb > qa else "[[C]]")
        out = {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
               "choices": [{"index": 0, "finish_reason": "stop",
                            "message": {"role": "assistant", "content": text}}],
               "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture()
def fake_judge():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeJudge)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_collect_from_an_openai_api_judge_and_the_command(fake_judge, tmp_path, capsys):
    pytest.importorskip("openai")
    from plyx.specs.cli import main

    answers = tmp_path / "answers.jsonl"
    answers.write_text("".join(json.dumps({"question_id": q, "question": f"question {q}",
                                           "answers": {"low": "quality 1", "mid": "quality 2", "high": "quality 3"}})
                               + "\n" for q in range(1, 9)))
    out = tmp_path / "verdicts.jsonl"
    verdicts = collect_verdicts(answers, out, base_url=fake_judge, judge_model="judge")
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 8 * 3 * 2  # 8 questions x 3 pairs x both orders
    assert sum(bool(r.get("unparsed")) for r in records) == 6 and len(verdicts) == 42
    bias = position_bias(verdicts)
    # even questions: always the first answer; odd ones (1, 5, 7) fair: 12 + 9 first-wins... of 42
    assert bias["first_position_wins"] == 4 * 6 + 9 and bias["biased"]
    assert bias["pairs_judged_both_orders"] == 21 and bias["flips"] == 12
    ranking = rank_models(verdicts, bootstrap=20)
    assert [r["model"] for r in ranking.rows] == ["high", "mid", "low"]

    # the command: collect, rank, table + JSON
    code = main(["rl", "judge", str(tmp_path / "v2.jsonl"), "--collect", str(answers), "--base-url", fake_judge,
                 "--judge-model", "judge", "--bootstrap", "20", "--json", str(tmp_path / "rank.json"),
                 "--no-progress"])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "BIASED" in text and "flip rate: 12 of 21" in text
    assert json.loads((tmp_path / "rank.json").read_text())["ranking"][0]["model"] == "high"
    # from the file alone
    assert main(["rl", "judge", str(tmp_path / "v2.jsonl"), "--bootstrap", "0", "--models", "low,mid"]) == 2
    assert "'high' is not among the models to rank" in capsys.readouterr().err
    (tmp_path / "none.jsonl").write_text("")
    assert main(["rl", "judge", str(tmp_path / "none.jsonl")]) == 2
    assert "no verdicts" in capsys.readouterr().err
