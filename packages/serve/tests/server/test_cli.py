"""``plyx serve PATH`` as a process: loads a plyx checkpoint with its tokenizer, serves, shuts down gracefully."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
from plyx.serve.server import SERVE_COMMAND

LAUNCH = ("import argparse, sys, torch; torch.set_num_threads(1); from plyx.serve.server import SERVE_COMMAND as c; "
          "p = argparse.ArgumentParser(); c.configure(p); sys.exit(c.run(p.parse_args(sys.argv[1:])))")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_command_shape():
    import argparse

    assert SERVE_COMMAND.name == "serve"
    p = argparse.ArgumentParser()
    SERVE_COMMAND.configure(p)
    args = p.parse_args(["/m", "--host", "0.0.0.0", "--port", "9", "--api-key", "k"])
    assert (args.path, args.host, args.port, args.api_key) == ("/m", "0.0.0.0", 9, "k")


def test_bad_options_name_the_field():
    import argparse

    import pytest
    from plyx.serve.server import serve_config_from_args
    from plyx.specs.errors import ConfigError

    p = argparse.ArgumentParser()
    SERVE_COMMAND.configure(p)
    with pytest.raises(ConfigError, match="max_batch_tokens"):
        serve_config_from_args(p.parse_args(["/m", "--max-batch-size", "64", "--max-batch-tokens", "8"]))
    cfg = serve_config_from_args(p.parse_args(["/models/tiny", "--no-prefix-caching", "--max-queue", "3"]))
    assert (cfg.served_name, cfg.prefix_caching, cfg.max_queue) == ("tiny", False, 3)


def test_serve_a_checkpoint_then_drain_on_sigterm(model_dir, greedy_reference, server_lm, bpe):
    port = free_port()
    env = {**os.environ, "PLYX_API_KEY": ""}
    proc = subprocess.Popen([sys.executable, "-c", LAUNCH, str(model_dir), "--host", "127.0.0.1", "--port",
                             str(port), "--api-key", "k1", "--drain-timeout", "20", "--log-level", "warning"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        headers = {"Authorization": "Bearer k1"}
        models = httpx.get(base + "/v1/models", headers=headers).json()
        assert models["data"][0]["id"] == model_dir.name
        # the chat template comes from the directory's tokenizer_config.json
        r = httpx.post(base + "/v1/chat/completions", headers=headers, timeout=60,
                       json={"model": model_dir.name, "messages": [{"role": "user", "content": "hello"}],
                             "max_tokens": 8, "temperature": 0})
        ids = bpe.encode("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).ids
        assert r.json()["choices"][0]["message"]["content"] == greedy_reference(server_lm, bpe, ids, 8).text

        # a long stream is in flight when SIGTERM arrives: it still completes, then the process exits 0
        lines: list[str] = []

        def stream():
            req = {"model": model_dir.name, "prompt": "hello", "max_tokens": 300, "stream": True,
                   "ignore_eos": True}
            with httpx.stream("POST", base + "/v1/completions", json=req, headers=headers, timeout=60) as resp:
                lines.extend(resp.iter_lines())

        t = threading.Thread(target=stream)
        t.start()
        while not lines:
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        t.join(60)
        # uvicorn re-raises the captured SIGTERM after its graceful shutdown: the conventional exit status
        assert proc.wait(60) in (0, -signal.SIGTERM)
        assert b"Traceback" not in proc.stdout.read()
        data = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert lines[-1] == "data: [DONE]" or lines[-2] == "data: [DONE]"
        assert data[-1]["choices"][0]["finish_reason"] == "length"
        assert len(data) > 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _broken_copies(model_dir, tmp_path):
    """Copies of the served checkpoint, each broken the way a download or a full disk breaks them."""
    import shutil

    out = {}
    for name in ("shard", "card", "tokenizer", "tokenizer_config", "arch"):
        d = tmp_path / name
        shutil.copytree(model_dir, d)
        out[name] = d
    shard = out["shard"] / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    for name, file in (("card", "model_card.json"), ("tokenizer", "tokenizer.json"),
                       ("tokenizer_config", "tokenizer_config.json")):
        f = out[name] / file
        f.write_text(f.read_text()[:40])
    arch = out["arch"]  # a Hugging Face directory of an architecture plyx does not implement
    for f in arch.iterdir():
        f.unlink()
    (arch / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"], "model_type": "foo"}))
    (arch / "model.safetensors").write_bytes(b"")
    return out


def test_a_checkpoint_that_cannot_be_served_is_one_line(model_dir, tmp_path, capsys, monkeypatch):
    """Truncated or unsupported: `plyx serve` prints the line `plyx model inspect --verify` prints (the model's
    own files) or one naming the file and the fix (tokenizer files), and no traceback."""
    import argparse

    import uvicorn
    from plyx.model._cli import command

    def never(self, *a, **k):  # a checkpoint that loads would serve forever: fail instead
        raise AssertionError("the broken checkpoint was served")

    monkeypatch.setattr(uvicorn.Server, "run", never)
    serve_p, inspect_p = argparse.ArgumentParser(), argparse.ArgumentParser()
    SERVE_COMMAND.configure(serve_p)
    command().configure(inspect_p)
    for name, d in _broken_copies(model_dir, tmp_path).items():
        assert SERVE_COMMAND.run(serve_p.parse_args([str(d), "--port", "0"])) == 2, name
        out = capsys.readouterr()
        lines = out.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in out.err + out.out, out
        line = lines[0]
        if name in ("shard", "card", "arch"):
            assert command().run(inspect_p.parse_args(["inspect", str(d), "--verify"])) == 1, name
            assert capsys.readouterr().out.strip() == line, name
        else:
            file = "tokenizer.json" if name == "tokenizer" else "tokenizer_config.json"
            assert str(d / file) in line and "restore it" in line, line
