"""Lineage DOT from receipts; PNG only when Graphviz is installed."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
from plyx.governance import lineage_dot, make_receipt, write_lineage
from plyx.governance._lineage import lineage_graph


def _chain(run: dict[str, Path]) -> list[dict]:
    ckpt = run["checkpoint"]
    first = make_receipt(base=ckpt, kind="checkpoint", outputs=[ckpt / "model.safetensors"], run_id="r1", step=10,
                         inputs={"corpus": run["data"], "tokenizer": run["tokenizer"]})
    export = make_receipt(base=run["export"], kind="export", outputs=[run["export"] / "model.onnx"],
                          inputs={"source_checkpoint": ckpt}, parents=[first["content_id"]], format="onnx")
    return [first, export]


def test_chain_data_tokenizer_run_checkpoint_export(toy_run: dict[str, Path]) -> None:
    receipts = _chain(toy_run)
    nodes, edges = lineage_graph(receipts)
    kinds = {node: kind for node, (kind, _) in nodes.items()}
    by_kind = {kind: node for node, kind in kinds.items()}
    assert set(by_kind) == {"data", "tokenizer", "run", "checkpoint", "export"}
    pairs = {(kinds[a], kinds[b]) for a, b, _ in edges}
    assert pairs == {("data", "tokenizer"), ("tokenizer", "run"), ("run", "checkpoint"), ("checkpoint", "export")}
    dot = lineage_dot(receipts)
    assert dot.startswith("digraph lineage {") and dot.rstrip().endswith("}")
    assert dot.count("->") == 4 and "checkpoint step 10" in dot and "export (onnx)" in dot
    assert lineage_dot(list(reversed(receipts))) == dot  # deterministic


def test_shared_inputs_are_one_node(toy_run: dict[str, Path]) -> None:
    ckpt = toy_run["checkpoint"]
    a = make_receipt(base=ckpt, kind="checkpoint", outputs=[ckpt / "model.safetensors"], run_id="r", step=1,
                     inputs={"corpus": toy_run["data"]})
    b = make_receipt(base=ckpt, kind="checkpoint", outputs=[ckpt / "model_card.json"], run_id="r", step=2,
                     inputs={"corpus": toy_run["data"]})
    nodes, edges = lineage_graph([a, b])
    assert sorted(kind for kind, _ in nodes.values()) == ["checkpoint", "checkpoint", "data", "run"]
    assert len(edges) == 3


def test_png_skipped_cleanly_without_graphviz(toy_run: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
                                              plyx, capsys: pytest.CaptureFixture[str]) -> None:
    from plyx.governance import write_receipt

    receipts = _chain(toy_run)
    paths = []
    for i, r in enumerate(receipts):
        paths.append(str(write_receipt(toy_run["root"] / f"R{i}.json", r)))
    monkeypatch.setenv("PATH", "")  # no `dot` anywhere
    out = toy_run["root"] / "LINEAGE.dot"
    assert write_lineage(out, receipts) == [out]
    assert not out.with_suffix(".png").exists()
    assert plyx(["governance", "lineage", "--metadata", *paths, "--out", str(out)]) == 0
    assert "LINEAGE.png skipped" in capsys.readouterr().out


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` is not installed")
def test_png_rendered_with_graphviz(toy_run: dict[str, Path]) -> None:
    out = toy_run["root"] / "LINEAGE.dot"
    written = write_lineage(out, _chain(toy_run))
    assert written[1] == out.with_suffix(".png")
    assert written[1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(not hasattr(os, "fchmod"), reason="needs an executable script on PATH (POSIX)")
def test_png_rendering_calls_graphviz(toy_run: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Our side of the Graphviz call, with a stand-in `dot` that records its arguments."""
    bin_dir = toy_run["root"] / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "dot"
    fake.write_text(f"#!{sys.executable}\nimport sys\nargs = sys.argv[1:]\n"
                    "open(args[args.index('-o') + 1], 'wb').write(b'\\x89PNG' + ' '.join(args).encode())\n",
                    encoding="utf-8")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    out = toy_run["root"] / "LINEAGE.dot"
    written = write_lineage(out, _chain(toy_run))
    png = out.with_suffix(".png")
    assert written == [out, png]
    assert png.read_bytes() == b"\x89PNG" + f"-Tpng {out} -o {png}".encode()
    assert write_lineage(out, _chain(toy_run), png=False) == [out]
