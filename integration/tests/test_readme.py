"""The root README's walkthrough, run verbatim: train -> serve -> curl and openai -> export -> governance verify.

The blocks between the README's ``walkthrough`` and ``end of walkthrough`` markers are
extracted and run as written, in order, in a fresh directory: the ``plyx serve`` block in
the background (as a user leaves it running in a first terminal), every other bash block
with ``bash -eu``, the Python block with this interpreter. Only two things are set from
outside, both documented in the README: ``PORT`` (a free port) and the training's step
count (README command 1's ``plyx train`` runs with ``--steps 4``). The plyx cache points at
a tmp dir, so nothing outside the test's directories is read or written.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
BEGIN, END = "<!-- walkthrough:", "<!-- end of walkthrough -->"
STEPS = 4


def walkthrough_blocks(text: str) -> list[tuple[str, str]]:
    """(language, code) of each fenced block of the walkthrough section, in order."""
    start = text.index(BEGIN)
    section = text[start : text.index(END, start)]
    return [(lang, code) for lang, code in re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S)]


def command_one(text: str) -> str:
    """README command 1 (the line after ``# 1.``)."""
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("# 1."))
    return lines[at + 1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _json_docs(out: str) -> list[dict]:
    """The JSON documents curl printed back to back."""
    docs, decoder, i = [], json.JSONDecoder(), 0
    while i < len(out):
        if out[i].isspace():
            i += 1
            continue
        doc, i = decoder.raw_decode(out, i)
        docs.append(doc)
    return docs


def _wait_healthy(proc: subprocess.Popen[str], port: int, timeout: float = 180) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"plyx serve exited with {proc.returncode}:\n{proc.stdout.read() if proc.stdout else ''}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError("plyx serve did not come up")


def test_readme_walkthrough_runs_verbatim(tmp_path: Path) -> None:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed; the README's curl block cannot run")
    text = README.read_text(encoding="utf-8")
    blocks = walkthrough_blocks(text)
    assert [lang for lang, _ in blocks] == ["bash", "bash", "python", "bash"], "the walkthrough's shape changed"
    port = _free_port()
    env = {k: v for k, v in os.environ.items()
           if k not in {"PLYX_API_KEY", "PLYX_SIGNING_KEY", "PLYX_REQUIRE_SIGNING_KEY", "PLYX_SAFETY_POLICY",
                        "PLYX_DATA_DIR"}}
    env.update(PORT=str(port), PLYX_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    cwd = tmp_path / "checkout"
    cwd.mkdir()

    def bash(code: str, timeout: float = 420) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(["bash", "-euc", code], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)
        assert proc.returncode == 0, f"README block failed ({proc.returncode}):\n{code}\n{proc.stdout}\n{proc.stderr}"
        return proc

    # README command 1's training part, shortened (its install part is what this environment already did)
    train = command_one(text).split("&&")[-1].strip()
    assert train == "plyx train", f"README command 1 no longer ends in `plyx train`: {train!r}"
    trained = bash(f"{train} --steps {STEPS} --no-progress")
    serve_line = blocks[0][1].strip()
    printed = trained.stdout.split("next:\n", 1)[1]
    # what `plyx train` tells the user to run is what the README runs
    assert serve_line.split(" --port")[0] in printed and "model id shakespeare" in printed

    assert serve_line.startswith("plyx serve ")
    server = subprocess.Popen(["bash", "-euc", serve_line], cwd=cwd, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        _wait_healthy(server, port)
        completion, chat = _json_docs(bash(blocks[1][1], timeout=120).stdout)
        assert completion["object"] == "text_completion" and completion["model"] == "shakespeare"
        assert completion["usage"]["completion_tokens"] > 0
        assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["role"] == "assistant"

        client = subprocess.run([sys.executable, "-c", blocks[2][1]], cwd=cwd, env=env, capture_output=True,
                                text=True, timeout=120)
        assert client.returncode == 0, client.stderr
        assert client.stdout.strip(), "the openai block printed nothing"
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the session this test started for the server
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()

    verified = bash(blocks[3][1])
    assert "PASS - release exports/shakespeare" in verified.stdout
    assert (cwd / "exports" / "shakespeare" / "model.onnx").is_file()
