"""``bench/serving.py`` end to end on a tiny model: the client runs in a spawned process, the warm-up /
prefix-cache reset handshake happens, and every request's tokens are counted."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def serving():
    pytest.importorskip("transformers")
    pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    sys.path.insert(0, str(BENCH))  # the spawned client imports the module by name: it inherits sys.path
    try:
        import serving as module

        yield module
    finally:
        sys.path.remove(str(BENCH))


def test_benchmark_runs_the_client_in_another_process_and_reports_every_token(serving, tmp_path):
    argv = ["--model", "tiny", "--num-prompts", "4", "--input-len", "8", "--prefix-len", "32", "--output-len", "4",
            "--range-ratio", "0", "--threads", "1", "--skip-hf", "--out", str(tmp_path / "r")]
    assert serving.main(argv) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    on, off = report["runs"]
    for run in (on, off):
        assert (run["completed"], run["failed"], run["total_output_tokens"]) == (4, 0, 16)
        assert run["engine_steps"] >= 4 and run["engine_step_ms"] > 0
    # (whether the measured requests hit the shared prefix depends on their admission order: not asserted)
    assert on["prefix_caching"] and not off["prefix_caching"] and off["prefix_hit_rate"] == 0
    assert "engine step mean (ms)" in (tmp_path / "r.md").read_text()


def test_a_client_that_cannot_connect_fails_the_run_instead_of_hanging(serving):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    warmed = []
    with pytest.raises(RuntimeError, match="client process failed before sending the end of the warm-up"):
        serving.run_client(f"http://127.0.0.1:{port}/v1/completions", [serving.Request([1, 2], 2, 0.0)], 0,
                           lambda: warmed.append(True))
    assert warmed == []


def test_decode_heavy_run_against_generate_and_the_grouped_step(serving, tmp_path):
    argv = ["--model", "tiny", "--num-prompts", "4", "--max-concurrency", "4", "--input-len", "8", "--prefix-len", "0",
            "--output-len", "6", "--range-ratio", "0", "--threads", "1", "--skip-hf", "--skip-prefix-off",
            "--compare-grouped", "--vs-generate", "--out", str(tmp_path / "d")]
    assert serving.main(argv) == 0
    report = json.loads((tmp_path / "d.json").read_text())
    packed, grouped, gen = report["runs"]
    assert packed["packed_step"] and not grouped["packed_step"] and gen["name"].startswith("plyx reference decode loop")
    for run in (packed, grouped, gen):
        assert (run["completed"], run["failed"], run["total_output_tokens"]) == (4, 0, 24)
    ratio = packed["output_throughput"] / gen["output_throughput"]
    assert report["serving_vs_generate"] == pytest.approx(ratio)
    assert f"**{ratio:.2f}**" in (tmp_path / "d.md").read_text()


def test_profile_of_one_serving_step(tmp_path):
    pytest.importorskip("transformers")
    sys.path.insert(0, str(BENCH))
    try:
        import profile_serving
    finally:
        sys.path.remove(str(BENCH))
    assert profile_serving.main(["--model", "tiny", "--batch", "3", "--input-len", "8", "--prefix-len", "4",
                                 "--steps", "3", "--top", "5", "--out", str(tmp_path / "p")]) == 0
    text = (tmp_path / "p.txt").read_text()
    for part in ("decode-only step:", "mixed step (one prompt of 12 tokens + 3 decodes)", "packed step True",
                 "torch.profiler: one mixed step", "cProfile: host side"):
        assert part in text


def test_step_trace_records_every_measured_step_and_summarises_mixed_and_decode_steps(serving, tmp_path):
    argv = ["--model", "tiny", "--num-prompts", "4", "--input-len", "8", "--prefix-len", "8", "--output-len", "5",
            "--range-ratio", "0", "--threads", "1", "--skip-hf", "--skip-prefix-off", "--max-concurrency", "2",
            "--out", str(tmp_path / "t"), "--step-trace", str(tmp_path / "trace.jsonl")]
    assert serving.main(argv) == 0
    lines = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    steps, summary = lines[:-1], lines[-1]["summary"]
    run = json.loads((tmp_path / "t.json").read_text())["runs"][0]
    assert len(steps) == summary["steps"] == run["engine_steps"]  # the measured run's steps, all of them
    # every prompt token of the measured run is in some step's prefill (4 prompts of 16, some from the prefix cache)
    assert 0 < sum(s["prefill_tokens"] for s in steps) <= 4 * 16
    # every output token but each request's first comes from a decode row (the first samples after the prefill)
    assert sum(s["decode_rows"] for s in steps) == 4 * (5 - 1)
    assert summary["mixed_steps"] + summary["decode_steps"] == summary["steps"]
    assert summary["mixed_steps"] >= 2 and summary["decode_steps"] >= 1  # concurrency 2: arrivals while decoding
    assert {s["path"] for s in steps} == {"eager"}  # CPU: no graphs
    assert all(s["wall_ms"] > 0 for s in steps)
    mixed = [s["wall_ms"] for s in steps if s["prefill_tokens"]]
    assert abs(summary["mixed_step_ms"] - sum(mixed) / len(mixed)) < 1e-6
    assert "mixed-step mean (ms) / steps" in (tmp_path / "t.md").read_text()
    # what each step emitted adds up to every output token; one decode step each (CPU: decode_steps 1)
    assert sum(s["tokens"] for s in steps) == run["total_output_tokens"] == 4 * 5
    assert {s["steps"] for s in steps} == {1}
    where = summary["where"]
    assert sum(e["steps"] for e in where["by_kind"].values()) == len(steps)
    assert "where the serving run's time went" in (tmp_path / "t.md").read_text()


def test_stream_interval_run_beside_the_default(serving, tmp_path):
    """``--decode-steps 4 --compare-stream-interval 1``: a second server run with ``stream_interval`` 1, named so,
    every token of both runs counted (from the usage, whatever the chunking) and blocks run in both."""
    argv = ["--model", "tiny", "--num-prompts", "2", "--max-concurrency", "2", "--input-len", "8", "--prefix-len", "0",
            "--output-len", "12", "--range-ratio", "0", "--threads", "1", "--skip-hf", "--skip-prefix-off",
            "--decode-steps", "4", "--compare-stream-interval", "1", "--out", str(tmp_path / "s")]
    assert serving.main(argv) == 0
    default, grouped = json.loads((tmp_path / "s.json").read_text())["runs"]
    assert "stream_interval 1" in grouped["name"] and "stream_interval 0" in default["name"]
    for run in (default, grouped):
        assert (run["completed"], run["failed"], run["total_output_tokens"]) == (2, 0, 24)
        assert run["multi_step_blocks"] > 0
