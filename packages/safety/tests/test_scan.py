"""``plyx safety scan CORPUS`` and the other CLI actions, through the real ``plyx`` command."""

from __future__ import annotations

import json

from plyx.specs.cli import main


def make_corpus(root):
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("Contact jane.doe@example.com or +44 20 7946 0958.\nNothing else.")
    (root / "sub" / "b.jsonl").write_text(
        json.dumps({"id": 1, "text": "card 4111 1111 1111 1111 ok"}) + "\n"
        + json.dumps({"id": 2, "text": "clean line"}) + "\n"
        + json.dumps({"id": 3, "text": "key AKIAIOSFODNN7EXAMPLE"}) + "\n")
    (root / "ignored.bin").write_bytes(b"\x00\x01")


def test_scan_redacts_a_corpus_and_reports_without_raw_pii(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    make_corpus(corpus)
    policy = tmp_path / "p.toml"
    policy.write_text('version = 2\n[[documents]]\nid = "pii"\ndetector = "pii"\naction = "redact"\n'
                      '[[documents]]\nid = "drop-secrets"\ndetector = "secrets"\naction = "block"\n')
    code = main(["safety", "scan", str(corpus), "--policy", str(policy), "--out", str(tmp_path / "clean"),
                 "--report", str(tmp_path / "report.jsonl")])
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["documents"] == 4 and summary["flagged"] == 3 and summary["redacted"] == 2 and summary["dropped"] == 1
    assert summary["rules"] == {"pii": 3, "drop-secrets": 1}
    assert (tmp_path / "clean" / "a.txt").read_text() == "Contact [EMAIL] or [PHONE].\nNothing else."
    rows = [json.loads(line) for line in (tmp_path / "clean" / "sub" / "b.jsonl").read_text().splitlines()]
    assert rows == [{"id": 1, "text": "card [CREDIT_CARD] ok"}, {"id": 2, "text": "clean line"}]
    report = (tmp_path / "report.jsonl").read_text()
    for raw in ("jane.doe", "4111", "AKIA", "7946"):
        assert raw not in report
    assert {r["file"] for r in map(json.loads, report.splitlines())} == {"a.txt", "sub/b.jsonl"}


def test_scan_report_only_and_bad_corpus(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    make_corpus(corpus)
    assert main(["safety", "scan", str(corpus)]) == 0  # built-in default policy, nothing written
    assert json.loads(capsys.readouterr().out)["written"] == []
    assert main(["safety", "scan", str(tmp_path / "missing")]) == 1
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    assert main(["safety", "scan", str(tmp_path / "bad.jsonl")]) == 1
    assert "--text-field" in capsys.readouterr().err


def test_check_and_detectors_commands(tmp_path, capsys):
    assert main(["safety", "check", "builtin:default"]) == 0
    assert "block-injection" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 2\ninput:\n  - id: r9\n    detector: regex\n    action: block\n"
                   "    options: {patterns: ['[a-']}\n")
    assert main(["safety", "check", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "rule 'r9'" in err and "invalid regular expression" in err and "$.input[0].options.patterns[0]" in err
    assert main(["safety", "detectors"]) == 0
    out = capsys.readouterr().out
    assert "prompt_injection" in out and "jailbreak" in out and "plyx-safety" in out
