"""``bench/step_trace_report.py``: a serving run's wall time split by kind of engine step and into waves."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def report():
    sys.path.insert(0, str(BENCH))
    try:
        import step_trace_report as module

        yield module
    finally:
        sys.path.remove(str(BENCH))


def _row(t_s, wall_ms, *, decode_rows=4, prefill=0, seqs=4, **extra):
    return {"t_s": t_s, "wall_ms": wall_ms, "decode_rows": decode_rows, "prefill_tokens": prefill,
            "batch_seqs": seqs, "path": "eager", **extra}


def test_a_trace_of_two_waves_splits_into_kinds_and_phases(report, tmp_path):
    rows = [_row(0.010, 5.0, prefill=32, decode_rows=0),  # wave 1 arrives
            _row(0.016, 2.0),  # a single decode step
            _row(0.020, 10.0, decode_rows=36), _row(0.030, 10.0, decode_rows=36),  # blocks (look-ahead rows)
            _row(0.041, 4.0, prefill=16, decode_rows=2),  # the wave boundary
            _row(0.046, 10.0, decode_rows=36)]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n" + json.dumps({"summary": {}}) + "\n")
    got = report.analyse(report.load(path))
    assert got["total_ms"] == pytest.approx(56.0) and got["before_first_ms"] == pytest.approx(10.0)
    kinds = got["by_kind"]
    assert (kinds["mixed steps"]["steps"], kinds["mixed steps"]["ms"]) == (2, 9.0)
    assert (kinds["multi-step blocks"]["steps"], kinds["multi-step blocks"]["ms"]) == (3, 30.0)
    assert (kinds["single decode steps"]["steps"], kinds["single decode steps"]["ms"]) == (1, 2.0)
    # 10 ms before the first step, 41 inside steps, 5 between them (gaps of 1, 2, 0, 1 and 1 ms)
    assert got["between_ms"] == pytest.approx(56.0 - 10.0 - 41.0)
    assert [(p["kind"], p["first"], p["last"]) for p in got["phases"]] == [
        ("other steps", 0, 1), ("blocks", 2, 3), ("other steps", 4, 4), ("blocks", 5, 5)]
    assert got["phases"][1]["ms"] == pytest.approx(20.0)
    text = report.render(got)
    assert "| multi-step blocks | 3 | 30 | 53.6% | 10.00 | - |" in text and "median multi-step block: 10.00 ms" in text


def test_recorded_steps_and_tokens_decide_the_kind(report):
    rows = [_row(0.0, 8.0, decode_rows=4, steps=8, tokens=32, wait_ms=0.5),
            _row(0.01, 1.0, decode_rows=4, steps=1, tokens=4, wait_ms=0.0)]
    got = report.analyse(rows)
    kinds = got["by_kind"]
    assert kinds["multi-step blocks"] == {"steps": 1, "ms": 8.0, "mean_ms": 8.0, "tokens": 32, "wait_ms": 0.5}
    assert kinds["single decode steps"]["tokens"] == 4
    assert "| multi-step blocks (32 tokens) | 1 | 8 | 72.7% | 8.00 | 0.5 |" in report.render(got)


def test_an_empty_trace_is_a_clear_error(report):
    with pytest.raises(ValueError, match="no steps"):
        report.analyse([])
