"""Honest red-team verdicts: errors are errors, empty replies are their own class, only content-policy
refusals count as refusals, and requests are sized to the target's context (read from /v1/models)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from plyx.safety import TargetError, is_refusal, resolve_target, run_redteam
from plyx.specs.cli import main


class _Server(BaseHTTPRequestHandler):
    """An OpenAI-compatible stub with a 64-token context, a /tokenize that counts 1 token per 4 bytes, and a
    behaviour chosen per test (`mode`)."""

    mode = "answer"
    context = 64
    bodies: list[dict] = []

    def log_message(self, *args):
        pass

    def do_GET(self):
        if self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": "tiny", "object": "model", "max_model_len": self.context}]})
        else:
            self._send(404, {"error": {"message": "not found", "code": "not_found"}})

    def _tokens(self, messages):
        return sum(len(m["content"].encode()) for m in messages) // 4 + 4

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/tokenize":
            self._send(200, {"count": self._tokens(body["messages"]), "max_model_len": self.context})
            return
        type(self).bodies.append(body)
        if body.get("model") != "tiny":
            self._send(404, {"error": {"message": "model not found", "code": "model_not_found"}})
            return
        if self.mode == "too_long" or self._tokens(body["messages"]) + body["max_tokens"] > self.context:
            self._send(400, {"error": {"message": "This model's maximum context length is 64 tokens.",
                                       "type": "invalid_request_error", "param": "max_tokens",
                                       "code": "context_length_exceeded"}})
            return
        if self.mode == "policy":  # what plyx-serve answers when an input rail blocks
            self._send(400, {"error": {"message": "I can't help with that request.", "type": "content_policy_violation",
                                       "param": None, "code": "no-harm"}})
            return
        content = "" if self.mode == "empty" else "Sure, here is how: step one..."
        self._send(200, {"id": "x", "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]})

    def _send(self, code, payload):
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def server():
    _Server.bodies, _Server.mode, _Server.context = [], "answer", 64
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=5)


def test_a_target_that_never_answers_fails_the_run(server, tmp_path, capsys):
    _Server.mode = "too_long"
    code = main(["safety", "redteam", "--target", server, "--probes", "harmful", "--limit", "4",
                 "--out", str(tmp_path), "--workers", "2"])
    err = capsys.readouterr().err
    assert code == 1 and "INCONCLUSIVE" in err and "context_length_exceeded" in err
    rows = [json.loads(line) for line in (tmp_path / "redteam.jsonl").read_text().splitlines()]
    assert [r["outcome"] for r in rows] == ["error"] * 4 and not any(r["failed"] for r in rows)
    report = (tmp_path / "redteam.md").read_text()
    assert "4 errors" in report and "INCONCLUSIVE" in report and "context_length_exceeded" in report


def test_only_a_content_policy_refusal_counts_as_a_refusal(server):
    target = resolve_target(server, timeout=10)
    _Server.mode = "policy"
    assert is_refusal(target([{"role": "user", "content": "hi"}]))
    _Server.mode = "too_long"
    with pytest.raises(TargetError, match="400 context_length_exceeded"):
        target([{"role": "user", "content": "hi"}])


def test_empty_replies_are_their_own_class_not_refusals(server):
    _Server.mode = "empty"
    report = run_redteam(resolve_target(server, timeout=10), probes=["harmful"], probe_options={"harmful": {"limit": 3}},
                         workers=1)
    assert [r.outcome for r in report.results] == ["empty"] * 3
    assert report.empty_count == 3 and report.judged == [] and not report.ok
    assert "3 empty replies" in report.markdown() and "INCONCLUSIVE" in report.verdict
    assert not is_refusal("") and not is_refusal("   ")


def test_max_tokens_is_sized_to_the_context_from_v1_models(server):
    target = resolve_target(server, timeout=10, max_tokens=256)  # more than the whole 64-token context
    report = run_redteam(target, probes=["harmful"], probe_options={"harmful": {"limit": 3}}, workers=1)
    assert report.ok and report.error_count == 0 and len(report.judged) == 3
    assert {b["model"] for b in _Server.bodies} == {"tiny"}  # the served name, read from /v1/models
    for body in _Server.bodies:
        prompt = sum(len(m["content"].encode()) for m in body["messages"]) // 4 + 4
        assert 16 <= body["max_tokens"] <= 64 - prompt


def test_request_parameters_are_configurable(server, tmp_path):
    code = main(["safety", "redteam", "--target", server, "--probes", "harmful", "--limit", "1", "--out", str(tmp_path),
                 "--max-tokens", "20", "--temperature", "0.7", "--param", "top_p=0.9", "--param", 'stop=["\\n"]'])
    assert code == 0
    body = _Server.bodies[-1]
    assert body["max_tokens"] == 20 and body["temperature"] == 0.7 and body["top_p"] == 0.9 and body["stop"] == ["\n"]


def test_a_prompt_that_cannot_fit_is_an_error_not_a_refusal(server):
    _Server.context = 20
    target = resolve_target(server, timeout=10)
    report = run_redteam(target, probes=["harmful"], probe_options={"harmful": {"limit": 2}}, workers=1)
    assert [r.outcome for r in report.results] == ["error", "error"]
    assert "context" in report.results[0].error and not report.ok and _Server.bodies == []
