"""``plyx serve PATH``: one-line errors for what it cannot serve, and the model id a trained checkpoint is served as."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import httpx
import pytest
from plyx.serve.server import SERVE_COMMAND
from plyx.serve.server._paths import PathError, check_model_path, served_names


def _run(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    SERVE_COMMAND.configure(p)
    return SERVE_COMMAND.run(p.parse_args(argv))


def _run_dir(tmp_path: Path, model_dir: Path, name: str = "shakespeare") -> Path:
    """A training run's layout: <run>/checkpoints/step-000030 (a copy of model_dir) and latest -> it."""
    ckpts = tmp_path / name / "checkpoints"
    ckpts.mkdir(parents=True)
    shutil.copytree(model_dir, ckpts / "step-000030")
    (ckpts / "latest").symlink_to("step-000030")
    return tmp_path / name


def test_paths_it_cannot_serve_are_one_line_with_the_fix(tmp_path: Path, model_dir: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    run = _run_dir(tmp_path, model_dir)
    (tmp_path / "empty").mkdir()
    export = tmp_path / "export"
    export.mkdir()
    (export / "model.onnx").write_bytes(b"onnx")
    (export / "config.json").write_text("{}")
    (export / "plyx_export.json").write_text(json.dumps({"source": {"path": str(run / "checkpoints" / "step-000030")}}))
    (tmp_path / "file.bin").write_bytes(b"x")
    cases = {
        tmp_path / "nowhere": "does not exist; pass a checkpoint directory",
        tmp_path / "file.bin": "is a file, not a model directory",
        run: f"is a training run, not a checkpoint; serve one of its checkpoints: plyx serve {run / 'checkpoints' / 'latest'}",
        run / "checkpoints": "is a directory of checkpoints, not a checkpoint",
        tmp_path / "empty": "is an empty directory",
        export: f"is an ONNX export (for onnxruntime); plyx serve serves checkpoints: plyx serve {run}/checkpoints/step-000030",
    }
    for path, expected in cases.items():
        with pytest.raises(PathError) as info:
            check_model_path(path)
        assert expected in str(info.value), (path, str(info.value))
        assert _run([str(path), "--port", "0"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and expected in err, err
    assert check_model_path(run / "checkpoints" / "latest") == run / "checkpoints" / "latest"


def test_served_model_id_is_the_run_name_with_the_step_as_alias(tmp_path: Path, model_dir: Path) -> None:
    run = _run_dir(tmp_path, model_dir)
    latest = run / "checkpoints" / "latest"
    # the fixture's card has the default name: the run's directory names the model
    assert served_names(latest) == ("shakespeare", ("step-000030", "latest"))
    card = latest / "model_card.json"
    doc = json.loads(card.read_text())
    card.write_text(json.dumps({**doc, "name": "bard"}))  # what `plyx train --name bard` writes
    assert served_names(latest) == ("bard", ("step-000030", "latest"))
    assert served_names(latest, "custom") == ("custom", ("bard", "step-000030", "latest"))
    assert served_names(model_dir)[0] == model_dir.name  # a plain directory: its own name


def test_requests_may_name_an_alias(server_lm, bpe, serving) -> None:
    app = serving.make_app(server_lm, bpe, model_name="shakespeare", model_aliases=("step-000030",))
    with serving.serve(app) as running:
        models = httpx.get(running.base_url + "/v1/models", headers=running.headers).json()["data"]
        assert [m["id"] for m in models] == ["shakespeare", "step-000030"]
        assert models[1]["parent"] == "shakespeare"
        for name in ("shakespeare", "step-000030"):
            r = httpx.post(running.base_url + "/v1/completions", headers=running.headers, timeout=60,
                           json={"model": name, "prompt": "hello", "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200 and r.json()["model"] == "shakespeare"
        r = httpx.post(running.base_url + "/v1/completions", headers=running.headers, timeout=60,
                       json={"model": "nope", "prompt": "hello", "max_tokens": 2})
        assert r.status_code == 404 and "`shakespeare` (also as `step-000030`)" in r.json()["error"]["message"]


def test_served_model_name_flag(model_dir: Path) -> None:
    from plyx.serve.server import serve_config_from_args

    p = argparse.ArgumentParser()
    SERVE_COMMAND.configure(p)
    assert serve_config_from_args(p.parse_args([str(model_dir), "--served-model-name", "x"])).served_name == "x"
    assert serve_config_from_args(p.parse_args([str(model_dir), "--served-name", "y"])).served_name == "y"
