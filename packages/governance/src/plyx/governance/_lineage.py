"""Lineage graphs from receipts: data -> tokenizer -> run -> checkpoint -> export, as Graphviz DOT.

Nodes are identified by content (input digests, run ids, receipt content
ids), so the receipts of several checkpoints of one run share their data,
tokenizer and run nodes, and an export's receipt links to the checkpoint it
was made from through ``parents``. A PNG is rendered when Graphviz's ``dot``
is on PATH; without it the DOT file is the whole result.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from plyx.governance._errors import GovernanceError
from plyx.governance._files import write_text_atomic

__all__ = ["LINEAGE_FILE", "lineage_graph", "lineage_dot", "write_lineage", "render_png"]

LINEAGE_FILE = "LINEAGE.dot"
_STYLE = {
    "data": 'shape=cylinder, style=filled, fillcolor="#dbeafe"',
    "tokenizer": 'shape=component, style=filled, fillcolor="#fef3c7"',
    "run": 'shape=box, style="rounded,filled", fillcolor="#e5e7eb"',
    "checkpoint": 'shape=folder, style=filled, fillcolor="#dcfce7"',
    "export": 'shape=box3d, style=filled, fillcolor="#fce7f3"',
}


def _short(digest: Any) -> str:
    text = str(digest or "")
    return text.removeprefix("sha256:")[:12] if text else "unknown"


def lineage_graph(receipts: Sequence[Mapping[str, Any]]) -> tuple[dict[str, tuple[str, str]], list[tuple[str, str, str]]]:
    """(nodes: id -> (kind, label), edges: (from, to, label)) from receipts, deduplicated and sorted."""
    nodes: dict[str, tuple[str, str]] = {}
    edges: set[tuple[str, str, str]] = set()
    by_content = {r.get("content_id"): r for r in receipts}
    for r in receipts:
        kind = r.get("kind")
        rid = str(r.get("content_id"))
        if kind == "export":
            node = f"export_{_short(rid)}"
            nodes[node] = ("export", f"export ({r.get('format') or 'unknown format'})\\nreceipt {_short(rid)}")
            for parent in r.get("parents") or ():
                if parent in by_content and by_content[parent].get("kind") == "checkpoint":
                    edges.add((f"checkpoint_{_short(parent)}", node, f"exported as {r.get('format') or '?'}"))
            for entry in r.get("inputs") or ():
                if not any(p in by_content for p in r.get("parents") or ()):
                    src = f"input_{_short(entry.get('sha256'))}_{entry.get('name')}"
                    nodes[src] = ("checkpoint", f"{entry.get('name')}\\n{entry.get('path')}\\n{_short(entry.get('sha256'))}")
                    edges.add((src, node, "exported"))
            continue
        run = f"run_{r.get('run_id') or _short(rid)}"
        nodes[run] = ("run", f"run {r.get('run_id') or '(no run id)'}")
        if kind == "checkpoint":
            ckpt = f"checkpoint_{_short(rid)}"
            # a checkpoint saved outside a training loop has no step: say nothing rather than "None"
            at = f" step {r['step']}" if r.get("step") is not None else ""
            nodes[ckpt] = ("checkpoint", f"checkpoint{at}\\nreceipt {_short(rid)}")
            edges.add((run, ckpt, f"wrote{at}" if at else "wrote"))
        else:
            for out in r.get("outputs") or ():
                art = f"artifact_{_short(out.get('sha256'))}"
                nodes[art] = ("checkpoint", f"{out.get('path')}\\n{_short(out.get('sha256'))}")
                edges.add((run, art, "wrote"))
        inputs = r.get("inputs") or ()
        tokenizers = [e for e in inputs if "tokenizer" in str(e.get("name", "")).lower()]
        data = [e for e in inputs if e not in tokenizers]
        for e in inputs:
            kind_ = "tokenizer" if e in tokenizers else "data"
            nid = f"{kind_}_{_short(e.get('sha256'))}_{e.get('name')}"
            nodes[nid] = (kind_, f"{e.get('name')}\\n{e.get('path')}\\n{_short(e.get('sha256'))}")
        for t in tokenizers:
            tid = f"tokenizer_{_short(t.get('sha256'))}_{t.get('name')}"
            edges.add((tid, run, "tokenizes for"))
            for d in data:
                edges.add((f"data_{_short(d.get('sha256'))}_{d.get('name')}", tid, "tokenized by"))
        if not tokenizers:
            for d in data:
                edges.add((f"data_{_short(d.get('sha256'))}_{d.get('name')}", run, "consumed by"))
    return dict(sorted(nodes.items())), sorted(edges)


def _quote(text: str) -> str:
    # DOT string: escape quotes; keep the \n line breaks we put in labels
    return '"' + text.replace('"', '\\"') + '"'


def lineage_dot(receipts: Sequence[Mapping[str, Any]]) -> str:
    """The lineage of ``receipts`` as a Graphviz DOT digraph (deterministic text)."""
    if not receipts:
        raise GovernanceError("--metadata", "no receipts given", fix="pass one or more RECEIPT.json files")
    nodes, edges = lineage_graph(receipts)
    lines = ["digraph lineage {", "  rankdir=LR;", '  node [fontname="Helvetica", fontsize=10];',
             '  edge [fontname="Helvetica", fontsize=9];']
    for nid, (kind, label) in nodes.items():
        lines.append(f"  {_quote(nid)} [label={_quote(label)}, {_STYLE[kind]}];")
    for a, b, label in edges:
        lines.append(f"  {_quote(a)} -> {_quote(b)} [label={_quote(label)}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def render_png(dot_path: str | os.PathLike[str], timeout_s: float = 60.0) -> Path | None:
    """Render ``X.dot`` to ``X.png`` with Graphviz; None (and nothing written) when ``dot`` is not installed."""
    dot = shutil.which("dot")
    if dot is None:
        return None
    dot_path = Path(dot_path)
    png = dot_path.with_suffix(".png")
    try:
        subprocess.run([dot, "-Tpng", str(dot_path), "-o", str(png)], check=True, capture_output=True, timeout=timeout_s)
    except (OSError, subprocess.SubprocessError) as exc:
        raise GovernanceError(str(dot_path), f"Graphviz could not render it: {exc}",
                              fix="check the DOT file, or pass --no-png") from exc
    return png


def write_lineage(out: str | os.PathLike[str], receipts: Sequence[Mapping[str, Any]], *, png: bool = True) -> list[Path]:
    """Write the DOT file (and the PNG when asked and Graphviz is present); returns the written paths."""
    written = [write_text_atomic(out, lineage_dot(receipts))]
    if png:
        rendered = render_png(out)
        if rendered is not None:
            written.append(rendered)
    return written
