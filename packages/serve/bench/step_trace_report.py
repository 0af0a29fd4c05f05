"""Where a serving run's wall time went, from its ``--step-trace`` (``serving.py``): by kind of engine step.

Every line of a step trace is one ``Engine.step`` call (``t_s`` its start after the measured run's start,
``wall_ms`` its length, ``decode_rows``, ``prefill_tokens``, ``batch_seqs``, ``path``; traces written since
serve 1.7 also carry ``tokens``, the tokens the step emitted, ``steps``, the decode steps it ran, and ``wait_ms``, how
long the engine thread waited for the device to read a block back: near zero in the blocks' rows means the
host, not the device, set their pace). The
report splits the run into:

* **before the first step**: the client's first request on its way (HTTP, admission);
* **mixed steps**: a prefill chunk on board (the start of each wave of requests, and every wave boundary:
  a closed-loop client with ``--max-concurrency`` sends a request only when one of its streams ends);
* **multi-step blocks**: decode-only steps of several tokens per row (``decode_rows > batch_seqs``, or
  ``steps > 1`` where recorded);
* **single decode steps**: decode-only steps of one token per row;
* **between steps**: the engine thread outside ``step`` (dispatching outputs, taking requests).

    python packages/serve/bench/step_trace_report.py results/steps-cuda-h100-1.1b-decode-c32-2026-11-24.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

__all__ = ["analyse", "load", "render"]

KINDS = ("mixed steps", "multi-step blocks", "single decode steps")


def load(path: str | Path) -> list[dict[str, Any]]:
    """The trace's step rows (its closing summary line left out)."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [r for r in rows if "summary" not in r]


def _kind(row: dict[str, Any]) -> str:
    if row["prefill_tokens"]:
        return "mixed steps"
    if row.get("steps", 0) > 1 or (row["decode_rows"] > row["batch_seqs"] and "steps" not in row):
        return "multi-step blocks"
    return "single decode steps"


def analyse(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Wall ms by kind of step, the ms between steps and before the first, and the phases of a run in waves.

    Returns a dict: ``total_ms`` (trace start to the last step's end), ``before_first_ms``, ``between_ms``,
    ``by_kind`` (kind -> ``{"steps", "ms", "mean_ms", "tokens"}``; tokens only where recorded), ``block_ms``
    (median wall of a multi-step block), and ``phases``: the runs of consecutive steps of one kind with their
    first and last step index, start and ms (a wave boundary is the run of mixed and single steps between two
    runs of blocks).
    """
    if not rows:
        raise ValueError("the step trace has no steps: was --step-trace given to a run that served requests?")
    end = max(r["t_s"] * 1e3 + r["wall_ms"] for r in rows)
    inside = sum(r["wall_ms"] for r in rows)
    first = rows[0]["t_s"] * 1e3
    by_kind: dict[str, dict[str, Any]] = {}
    for kind in KINDS:
        mine = [r for r in rows if _kind(r) == kind]
        entry: dict[str, Any] = {"steps": len(mine), "ms": sum(r["wall_ms"] for r in mine),
                                 "mean_ms": statistics.fmean(r["wall_ms"] for r in mine) if mine else 0.0}
        if mine and all("tokens" in r for r in mine):
            entry["tokens"] = sum(r["tokens"] for r in mine)
        if mine and all("wait_ms" in r for r in mine):
            entry["wait_ms"] = sum(r["wait_ms"] for r in mine)
        by_kind[kind] = entry
    phases: list[dict[str, Any]] = []
    for i, r in enumerate(rows):
        kind = "blocks" if _kind(r) == "multi-step blocks" else "other steps"
        if phases and phases[-1]["kind"] == kind:
            p = phases[-1]
            p["last"], p["ms"] = i, r["t_s"] * 1e3 + r["wall_ms"] - p["start_ms"]
        else:
            phases.append({"kind": kind, "first": i, "last": i, "start_ms": r["t_s"] * 1e3, "ms": r["wall_ms"]})
    blocks = [r["wall_ms"] for r in rows if _kind(r) == "multi-step blocks"]
    return {"total_ms": end, "before_first_ms": first, "between_ms": end - first - inside, "by_kind": by_kind,
            "block_ms": statistics.median(blocks) if blocks else 0.0, "phases": phases}


def render(report: dict[str, Any]) -> str:
    """The analysis as a markdown table and a list of phases."""
    total = report["total_ms"]
    lines = ["| where | steps | ms | share | mean ms | waiting for the device (ms) |", "|---|---|---|---|---|---|",
             f"| before the first step | - | {report['before_first_ms']:.0f} | "
             f"{report['before_first_ms'] / total:.1%} | - | - |"]
    for kind, e in report["by_kind"].items():
        tokens = f" ({e['tokens']} tokens)" if "tokens" in e else ""
        wait = f"{e['wait_ms']:.1f}" if "wait_ms" in e else "-"
        lines.append(f"| {kind}{tokens} | {e['steps']} | {e['ms']:.0f} | {e['ms'] / total:.1%} | {e['mean_ms']:.2f} "
                     f"| {wait} |")
    lines.append(f"| between steps | - | {report['between_ms']:.0f} | {report['between_ms'] / total:.1%} | - | - |")
    lines.append(f"| **total** | - | {total:.0f} | 100% | - | - |")
    lines += ["", f"median multi-step block: {report['block_ms']:.2f} ms", "", "phases (consecutive steps of one kind):"]
    for p in report["phases"]:
        lines.append(f"- {p['kind']}: steps {p['first']}..{p['last']}, from {p['start_ms']:.0f} ms, {p['ms']:.0f} ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="a --step-trace JSON-lines file of serving.py")
    args = p.parse_args(argv)
    print(render(analyse(load(args.trace))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
