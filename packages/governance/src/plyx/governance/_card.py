"""Model cards: the sections of Mitchell et al. (2019) with Hugging Face YAML metadata, and a JSON sidecar.

Mitchell et al., "Model Cards for Model Reporting" (FAT* 2019) name nine
sections: model details, intended use, factors, metrics, evaluation data,
training data, quantitative analyses, ethical considerations, caveats and
recommendations. The card is filled from the receipt (inputs, config,
metrics, environment, git) and the SBOM; what the producer did not state is
written as "Not provided" with the metadata key that would fill it, never
invented. The YAML front matter follows the Hugging Face model card metadata
(``license``, ``library_name``, ``tags``, ``datasets``, ``model-index``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from plyx.governance._errors import GovernanceError
from plyx.governance._files import digest_file, digest_tree, write_text_atomic

__all__ = ["CARD_FILE", "CARD_JSON_FILE", "CARD_SCHEMA", "build_card", "render_card", "write_card", "SECTIONS"]

CARD_FILE = "MODEL_CARD.md"
CARD_JSON_FILE = "MODEL_CARD.json"
CARD_SCHEMA = "plyx.governance.model_card/1"
SECTIONS = ("model_details", "intended_use", "factors", "metrics", "evaluation_data", "training_data",
            "quantitative_analyses", "ethical_considerations", "caveats_and_recommendations")
_TITLES = {
    "model_details": "Model Details",
    "intended_use": "Intended Use",
    "factors": "Factors",
    "metrics": "Metrics",
    "evaluation_data": "Evaluation Data",
    "training_data": "Training Data",
    "quantitative_analyses": "Quantitative Analyses",
    "ethical_considerations": "Ethical Considerations",
    "caveats_and_recommendations": "Caveats and Recommendations",
}


def _missing(key: str) -> str:
    return f"Not provided. Set the metadata key `{key}` to fill this section."


def _numbers(values: Any) -> dict[str, float]:
    if not isinstance(values, Mapping):
        return {}
    return {str(k): v for k, v in sorted(values.items()) if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _sbom_summary(sbom: str | os.PathLike[str] | None) -> dict[str, Any] | None:
    if sbom is None or not Path(sbom).is_file():
        return None
    try:
        doc = json.loads(Path(sbom).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        doc = {}
    return {"path": Path(sbom).name, "sha256": digest_file(sbom), "format": doc.get("spdxVersion"),
            "packages": max(len(doc.get("packages", [])) - 1, 0), "namespace": doc.get("documentNamespace")}


def build_card(artifact: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *,
               receipt: Mapping[str, Any] | None = None, metadata: Mapping[str, Any] | None = None,
               sbom: str | os.PathLike[str] | None = None,
               base: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """The card as data (the JSON sidecar).

    Args:
        artifact: the model artifact the card describes (a file or directory), or
            a list of the files of one release.
        receipt: its reproducibility receipt, the source of facts.
        metadata: what the producer states: ``name``, ``version``, ``license``
            (SPDX id), ``description``, ``developers``, ``intended_use``, ``out_of_scope_use``,
            ``factors``, ``evaluation_data``, ``eval_metrics`` {name: value},
            ``ethical_considerations``, ``caveats``, ``datasets`` (Hub ids),
            ``metrics`` (training metrics, when there is no receipt).
        sbom: the SBOM to reference.
        base: the directory the card is written to (paths are relative to it).
    """
    paths = [Path(artifact)] if isinstance(artifact, (str, os.PathLike)) else [Path(a) for a in artifact]
    if not paths:
        raise GovernanceError("artifact", "a model card needs the artifact it describes", fix="pass its path")
    meta = dict(metadata or {})
    rec = dict(receipt or {})
    base = Path(base) if base is not None else paths[0].parent
    config = rec.get("config") or meta.get("config") or {}
    train_metrics = _numbers(rec.get("metrics") or meta.get("metrics"))
    eval_metrics = _numbers(meta.get("eval_metrics"))
    name = str(meta.get("name") or (config.get("name") if isinstance(config, Mapping) else None) or paths[0].stem)
    artifacts = [{"path": os.path.relpath(p, base).replace(os.sep, "/"),
                  "sha256": digest_file(p) if p.is_file() else digest_tree(p) if p.is_dir() else None}
                 for p in paths]
    inputs = [e for e in rec.get("inputs") or () if isinstance(e, Mapping)]
    # the export's own input is the checkpoint, not training data
    data_inputs = [e for e in inputs if "tokenizer" not in str(e.get("name", "")).lower()
                   and e.get("name") != "source_checkpoint"]
    model_config = config.get("model") if isinstance(config, Mapping) else None
    return {
        "schema": CARD_SCHEMA,
        "name": name,
        "license": meta.get("license") or "",
        "format": rec.get("format") or meta.get("format"),
        "artifacts": artifacts,
        "receipt": rec.get("content_id"),
        "sbom": _sbom_summary(sbom),
        "model_details": {
            "name": name,
            "version": meta.get("version") or "",
            "description": meta.get("description") or "",
            "developers": meta.get("developers") or "",
            "created": rec.get("created"),
            "run_id": rec.get("run_id"),
            "step": rec.get("step"),
            "architecture": model_config if isinstance(model_config, Mapping) else None,
            "git": rec.get("git"),
            "python": (rec.get("python") or {}).get("version"),
            "plyx": {k: v for k, v in (rec.get("packages") or {}).items() if str(k).startswith("plyx")},
            "techniques": rec.get("techniques"),
        },
        "intended_use": {"primary": meta.get("intended_use") or _missing("intended_use"),
                         "out_of_scope": meta.get("out_of_scope_use") or _missing("out_of_scope_use")},
        "factors": meta.get("factors") or _missing("factors"),
        "metrics": {"training": sorted(train_metrics), "evaluation": sorted(eval_metrics)},
        "evaluation_data": meta.get("evaluation_data") or _missing("evaluation_data"),
        "training_data": [{"name": e.get("name"), "path": e.get("path"), "sha256": e.get("sha256")}
                          for e in data_inputs] or _missing("inputs"),
        "quantitative_analyses": {"training": train_metrics, "evaluation": eval_metrics},
        "ethical_considerations": meta.get("ethical_considerations") or _missing("ethical_considerations"),
        "caveats_and_recommendations": meta.get("caveats") or (
            "Trained and described by an automated pipeline; verify the release against its signer's key "
            "(`plyx governance verify DIR --key SIGNER.pub`) before use and evaluate it on your own data."),
        "datasets": list(meta.get("datasets") or ()),
        "eval_dataset": meta.get("eval_dataset") or "",
    }


def _yaml_scalar(value: Any) -> str:
    # a JSON scalar is a valid YAML flow scalar (double-quoted strings, numbers, true/false/null)
    return json.dumps(value, ensure_ascii=False)


def _front_matter(card: Mapping[str, Any]) -> list[str]:
    lines = ["---"]
    lic = str(card.get("license") or "")
    lines.append(f"license: {_yaml_scalar(lic.lower() if lic else 'other')}")
    lines.append('library_name: "plyx"')
    lines.append('pipeline_tag: "text-generation"')
    tags = ["plyx", "plyx-governance"] + ([str(card["format"])] if card.get("format") else [])
    lines.append("tags:")
    lines += [f"- {_yaml_scalar(t)}" for t in tags]
    if card.get("datasets"):
        lines.append("datasets:")
        lines += [f"- {_yaml_scalar(str(d))}" for d in card["datasets"]]
    quant = card["quantitative_analyses"]
    results = []
    if quant["evaluation"]:
        results.append((card.get("eval_dataset") or "evaluation data", "evaluation", quant["evaluation"]))
    if quant["training"]:
        results.append(("training data", "training", quant["training"]))
    if results:
        lines += ["model-index:", f"- name: {_yaml_scalar(card['name'])}", "  results:"]
        for dataset, split, values in results:
            lines += ["  - task:", '      type: "text-generation"', "    dataset:",
                      f"      name: {_yaml_scalar(dataset)}", f"      type: {_yaml_scalar(dataset)}",
                      f"      split: {_yaml_scalar(split)}", "    metrics:"]
            for metric, value in values.items():
                lines += [f"    - type: {_yaml_scalar(metric)}", f"      value: {_yaml_scalar(value)}",
                          f"      name: {_yaml_scalar(f'{split} {metric}')}"]
    lines.append("---")
    return lines


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return "```json\n" + json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n```"


def _techniques_line(t: Mapping[str, Any]) -> str:
    """One line of how the model was produced (from the receipt's ``techniques``)."""
    parts = [f"{k.replace('_', ' ')} {t[k]}" for k in ("precision", "compile", "attention_backend", "optimizer",
                                                       "parallel_strategy") if t.get(k)]
    if t.get("parallelism"):
        parts.append("parallelism " + ", ".join(f"{k}={v}" for k, v in sorted(t["parallelism"].items())))
    kernels = [f"{k.get('op')}={k.get('implementation')}" + (f" ({k['distribution']} {k.get('version', '')})".rstrip()
                                                              if k.get("distribution") else "")
               for k in t.get("kernels") or () if isinstance(k, Mapping)]
    if kernels:
        parts.append("kernels " + "; ".join(kernels))
    if t.get("data_fingerprint"):
        parts.append(f"data {str(t['data_fingerprint'])[:23]}...")
    return ", ".join(parts) or "none recorded"


def _details(card: Mapping[str, Any]) -> list[str]:
    d = card["model_details"]
    git = d["git"] or {}
    lines = [d["description"] or _missing("description"), "", f"- Format: {card.get('format') or 'not recorded'}"]
    lines += [f"- Artifact: `{a['path']}`, sha256 `{a['sha256']}`" for a in card["artifacts"]]
    lines += [
        f"- Version: {d['version'] or 'not set'}; license: {card['license'] or 'not stated (metadata key `license`)'}",
        f"- Developers: {d['developers'] or 'not stated (metadata key `developers`)'}",
        f"- Created: {d['created'] or 'unknown'}; run `{d['run_id']}`" + (f", step {d['step']}" if d['step'] is not None else ""),
        f"- Source: git {git.get('commit', 'unknown')}{' (dirty work tree)' if git.get('dirty') else ''}; "
        f"Python {d['python']}",
        f"- Reproducibility receipt: `{card['receipt']}`",
    ]
    techniques = d.get("techniques")
    if isinstance(techniques, Mapping):
        lines.append("- Techniques: " + _techniques_line(techniques))
    sbom = card.get("sbom")
    lines.append(f"- SBOM: `{sbom['path']}` ({sbom['format']}, {sbom['packages']} packages)" if sbom else "- SBOM: none")
    if d["architecture"]:
        lines += ["", "Architecture:", "", _text(d["architecture"])]
    return lines


def _quantitative(card: Mapping[str, Any]) -> list[str]:
    rows = [f"| {split} | {k} | {v} |" for split in ("training", "evaluation")
            for k, v in card["quantitative_analyses"][split].items()]
    if not rows:
        return [_missing("eval_metrics")]
    return ["| split | metric | value |", "| --- | --- | --- |", *rows]


def render_card(card: Mapping[str, Any]) -> str:
    """The Markdown card with its YAML front matter."""
    training = card["training_data"]
    body: dict[str, list[str]] = {
        "model_details": _details(card),
        "intended_use": [f"Primary uses: {card['intended_use']['primary']}", "",
                         f"Out of scope: {card['intended_use']['out_of_scope']}"],
        "factors": [_text(card["factors"])],
        "metrics": [f"Training metrics reported: {', '.join(card['metrics']['training']) or 'none'}.",
                    f"Evaluation metrics reported: {', '.join(card['metrics']['evaluation']) or 'none'}."],
        "evaluation_data": [_text(card["evaluation_data"])],
        "training_data": ([f"- `{e['name']}`: `{e['path']}` (sha256 `{e['sha256']}`)" for e in training]
                          if isinstance(training, list) else [training]),
        "quantitative_analyses": _quantitative(card),
        "ethical_considerations": [_text(card["ethical_considerations"])],
        "caveats_and_recommendations": [_text(card["caveats_and_recommendations"])],
    }
    lines = _front_matter(card) + ["", f"# Model card: {card['name']}", ""]
    for section in SECTIONS:
        lines += [f"## {_TITLES[section]}", ""] + body[section] + [""]
    return "\n".join(lines)


def write_card(out: str | os.PathLike[str], artifact: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *,
               receipt: Mapping[str, Any] | None = None, metadata: Mapping[str, Any] | None = None,
               sbom: str | os.PathLike[str] | None = None) -> tuple[Path, Path]:
    """Write ``MODEL_CARD.md`` to ``out`` and its JSON sidecar beside it (``out`` with ``.json``)."""
    out = Path(out)
    card = build_card(artifact, receipt=receipt, metadata=metadata, sbom=sbom, base=out.parent)
    sidecar = out.with_suffix(".json")
    write_text_atomic(out, render_card(card))
    write_text_atomic(sidecar, json.dumps(card, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    return out, sidecar
