"""Model cards: Mitchell et al. sections, Hugging Face YAML metadata, JSON sidecar."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from plyx.governance import make_receipt, write_card, write_receipt, write_sbom
from plyx.governance._card import SECTIONS
from plyx.governance._files import digest_file

TITLES = ["Model Details", "Intended Use", "Factors", "Metrics", "Evaluation Data", "Training Data",
          "Quantitative Analyses", "Ethical Considerations", "Caveats and Recommendations"]


def _front_matter(text: str) -> dict:
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def test_card_from_receipt_metrics_and_sbom(toy_run: dict[str, Path], plyx) -> None:
    export = toy_run["export"]
    receipt = make_receipt(base=export, kind="export", outputs=[export / "model.onnx"], format="onnx",
                           inputs={"corpus": toy_run["data"], "tokenizer": toy_run["tokenizer"]},
                           metrics={"loss": 2.25, "tokens": 1000}, config={"model": {"d_model": 64}})
    write_receipt(export / "RECEIPT.json", receipt)
    write_sbom(export / "SBOM.spdx.json", "toy", files=[export / "model.onnx"])
    fields = export / "card.json"
    fields.write_text(json.dumps({"license": "Apache-2.0", "intended_use": "Research on tiny language models.",
                                  "eval_metrics": {"perplexity": 9.5}, "eval_dataset": "wikitext-2",
                                  "datasets": ["wikitext"]}), encoding="utf-8")
    out = export / "MODEL_CARD.md"
    assert plyx(["governance", "card", str(export / "model.onnx"), "--metadata", str(export / "RECEIPT.json"),
                 "--card-metadata", str(fields), "--sbom", str(export / "SBOM.spdx.json"), "--name", "toy",
                 "--out", str(out)]) == 0
    text = out.read_text(encoding="utf-8")
    headings = [line[3:] for line in text.splitlines() if line.startswith("## ")]
    assert headings == TITLES
    meta = _front_matter(text)
    assert meta["license"] == "apache-2.0" and meta["library_name"] == "plyx" and meta["datasets"] == ["wikitext"]
    results = meta["model-index"][0]["results"]
    assert meta["model-index"][0]["name"] == "toy"
    got = {(r["dataset"]["name"], m["type"]): m["value"] for r in results for m in r["metrics"]}
    assert got == {("wikitext-2", "perplexity"): 9.5, ("training data", "loss"): 2.25,
                   ("training data", "tokens"): 1000}
    assert "Research on tiny language models." in text
    assert "Not provided. Set the metadata key `factors`" in text  # not invented
    assert digest_file(toy_run["data"]) in text  # training data from the receipt
    sidecar = json.loads(out.with_suffix(".json").read_text(encoding="utf-8"))
    assert set(SECTIONS) <= set(sidecar)
    assert sidecar["receipt"] == receipt["content_id"]
    assert sidecar["artifacts"] == [{"path": "model.onnx", "sha256": digest_file(export / "model.onnx")}]
    assert sidecar["sbom"]["sha256"] == digest_file(export / "SBOM.spdx.json")
    assert sidecar["model_details"]["architecture"] == {"d_model": 64}
    assert [d["name"] for d in sidecar["training_data"]] == ["corpus"]


def test_card_without_receipt(tmp_path: Path) -> None:
    (tmp_path / "w.bin").write_bytes(b"w")
    md, sidecar = write_card(tmp_path / "MODEL_CARD.md", tmp_path / "w.bin", metadata={"name": "bare"})
    meta = _front_matter(md.read_text(encoding="utf-8"))
    assert meta["license"] == "other" and "model-index" not in meta
    card = json.loads(sidecar.read_text(encoding="utf-8"))
    assert card["receipt"] is None and card["training_data"].startswith("Not provided")
