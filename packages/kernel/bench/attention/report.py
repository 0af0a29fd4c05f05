"""Merge the attention benchmarks' JSON files into one JSON and one Markdown table.

    python report.py flash.json paged.json --anchors anchors.json --out-json R.json --out-md R.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys


def _f(x: object, fmt: str = "{:.0f}") -> str:
    return fmt.format(x) if isinstance(x, (int, float)) else "-"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("flash")
    p.add_argument("paged")
    p.add_argument("--tests", default=None, help="pytest summary line of the GPU parity tests")
    p.add_argument("--out-json", required=True)
    p.add_argument("--out-md", required=True)
    a = p.parse_args()
    data: dict[str, object] = {"date": datetime.date.today().isoformat()}
    for name, path in (("flash", a.flash), ("paged", a.paged)):
        try:
            with open(path) as f:
                data[name] = json.load(f)
        except (OSError, ValueError) as exc:
            data[name] = {"error": f"{path}: {exc}"}
    if a.tests:
        with open(a.tests) as f:
            data["gpu_tests"] = f.read().strip().splitlines()[-1:]
    with open(a.out_json, "w") as f:
        json.dump(data, f, indent=1)

    flash, paged = data["flash"], data["paged"]
    lines = [f"# plyx-kernel attention benchmarks - {flash.get('device', paged.get('device', '?'))} - {data['date']}", ""]
    lines.append(f"torch {flash.get('torch', '?')}, triton {flash.get('triton', '?')}; "
                 f"GPU parity tests: {' '.join(data.get('gpu_tests', ['not run']))}")
    lines += ["", "## Flash attention, bf16, Dh 128, 16 heads, B x T = 16384 (TFLOP/s; fwd+bwd counts 3.5x fwd FLOPs)", "",
              "| causal | T | triton fwd | sdpa flash fwd | cudnn fwd | triton/flash | triton/cudnn | triton fwd+bwd | "
              "sdpa flash fwd+bwd | cudnn fwd+bwd | triton/flash | triton/cudnn | err vs sdpa |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in flash.get("cases", []):
        t, fl, cu = row["triton"], row.get("sdpa_flash", {}), row.get("sdpa_cudnn", {})
        def ratio(x, y, key):
            return _f(x[key] / y[key], "{:.2f}") if key in x and key in y else "-"
        lines.append(
            f"| {row['causal']} | {row['T']} | {_f(t['fwd_tflops'])} | {_f(fl.get('fwd_tflops'))} | "
            f"{_f(cu.get('fwd_tflops'))} | {ratio(t, fl, 'fwd_tflops')} | {ratio(t, cu, 'fwd_tflops')} | "
            f"{_f(t['fwd_bwd_tflops'])} | {_f(fl.get('fwd_bwd_tflops'))} | {_f(cu.get('fwd_bwd_tflops'))} | "
            f"{ratio(t, fl, 'fwd_bwd_tflops')} | {ratio(t, cu, 'fwd_bwd_tflops')} | "
            f"{_f(row.get('rel_err_vs_sdpa'), '{:.1e}')} |")
    lines += ["", "Default configs (no autotuning, what runs unless PLYX_ATTENTION_AUTOTUNE=1), TFLOP/s:", "",
              "| causal | T | default fwd | /flash | /cudnn | default fwd+bwd | /flash | /cudnn |", "|---|---|---|---|---|---|---|---|"]
    for row in flash.get("cases", []):
        t, fl, cu = row.get("triton_default", {}), row.get("sdpa_flash", {}), row.get("sdpa_cudnn", {})
        def r2(x, y, key):
            return _f(x[key] / y[key], "{:.2f}") if key in x and key in y else "-"
        lines.append(f"| {row['causal']} | {row['T']} | {_f(t.get('fwd_tflops'))} | {r2(t, fl, 'fwd_tflops')} | "
                     f"{r2(t, cu, 'fwd_tflops')} | {_f(t.get('fwd_bwd_tflops'))} | {r2(t, fl, 'fwd_bwd_tflops')} | "
                     f"{r2(t, cu, 'fwd_bwd_tflops')} |")
    if flash.get("configs"):
        lines += ["", "Autotuned configs: " + "; ".join(f"`{k}`: {v}" for k, v in flash["configs"].items())]
    lines += ["", f"## Paged decode, bf16, 16 q heads / 4 kv heads, Dh 128, blocks of 16, 1 new token "
              f"(copy bandwidth {_f(paged.get('copy_GBps'))} GB/s, read + write)", "",
              "call = whole call timed with do_bench (Python + launches + kernels); kernel = GPU time of the "
              "launched kernels (profiler), what a CUDA-graph decode step pays.", "",
              "| batch | context | splits | KV MB | triton call us | call GB/s | % of copy | triton kernel us | kernel GB/s | "
              "% of copy | sdpa call GB/s | sdpa kernel GB/s | err vs sdpa |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in paged.get("cases", []):
        t, s = row["triton"], row.get("sdpa_contiguous", {})
        km = t.get("kernel_ms")
        lines.append(f"| {row['B']} | {row['ctx']} | {row['splits']} | {_f(row['kv_MB'], '{:.1f}')} | "
                     f"{_f(t['ms'] * 1e3, '{:.1f}')} | {_f(t['GBps'])} | {_f(100 * t['of_copy'], '{:.1f}')} | "
                     f"{_f(km * 1e3 if km else None, '{:.1f}')} | {_f(t.get('kernel_GBps'))} | "
                     f"{_f(100 * t['kernel_of_copy'] if 'kernel_of_copy' in t else None, '{:.1f}')} | "
                     f"{_f(s.get('GBps'))} | {_f(s.get('kernel_GBps'))} | {_f(row.get('rel_err_vs_sdpa'), '{:.1e}')} |")
    if paged.get("config"):
        lines += ["", f"Paged launch config: {paged['config']}"]
    for r in paged.get("sweep", []):
        lines.append(f"- sweep {r}")
    with open(a.out_md, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
