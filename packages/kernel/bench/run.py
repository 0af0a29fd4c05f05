"""Run every kernel benchmark side by side with its peers; print a table, write JSON and text results.

    python packages/kernel/bench/run.py --out DIR [--only rmsnorm,swiglu] [--budget-s 300]

Needs CUDA, Triton and (for the Liger column) liger-kernel. Each kernel module
``bench_<name>.py`` gives its cases; sizes live in ``shapes.py``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

MODULES = ["bench_rmsnorm", "bench_swiglu", "bench_rope", "bench_cross_entropy", "bench_linear_cross_entropy",
           "bench_matmul"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-results")))
    parser.add_argument("--only", default="", help="comma-separated module suffixes (rmsnorm,matmul...)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="stop starting new measurements after this")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: kernel benchmarks skipped")
        return 0
    import triton
    from _harness import ceilings, dump, measure, print_table

    start = time.time()
    deadline = start + args.budget_s
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        import liger_kernel  # noqa: F401

        liger = importlib.metadata.version("liger-kernel")
    except Exception as exc:  # the Liger column is optional
        liger = f"not available ({exc})"
    meta = {"device": torch.cuda.get_device_name(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "triton": triton.__version__, "liger_kernel": liger}
    meta.update(ceilings())
    print(meta, flush=True)
    results = []
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    for name in MODULES:
        if only and name.removeprefix("bench_") not in only:
            continue
        for case in importlib.import_module(name).cases():
            results += measure(case, meta, deadline)
            print_table([r for r in results if r.kernel == case.kernel and r.shape == case.shape])
    table = print_table(results)
    stamp = meta["device"].replace(" ", "-") + "-" + meta["date"][:10]
    (args.out / f"kernels-{stamp}.txt").write_text(f"{meta}\n\n{table}\n")
    dump(args.out / f"kernels-{stamp}.json", meta, results)
    print(f"benchmarks done in {time.time() - start:.0f} s; results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
