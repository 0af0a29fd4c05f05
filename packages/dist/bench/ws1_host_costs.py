"""Host cost of FSDP2's per-step calls at world size 1, on the model of ``fsdp_ws1_vs_plain.py --preset 1b``.

The model is built on the meta device (no memory, no arithmetic) and sharded as ``DistStrategy`` shards it
at one rank (``fully_shard`` per block + root, bf16 ``param_dtype``, no reshard after forward); then each
call is timed alone over many repetitions on an in-process gloo group of one rank:

- ``set_requires_gradient_sync``: what ``DistStrategy.micro_batch`` called at every micro-batch before
  plyx-dist 1.4 (it walks every module to set the flag on each FSDP group); now only when the flag
  changes, which without accumulation is once a run.

    python packages/dist/bench/ws1_host_costs.py [--preset 1b] [--out results/ws1_host_costs.jsonl]

Rows (device name, date, microseconds per call) are appended to ``--out``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import _runs


def main() -> None:
    import torch
    import torch.distributed as dist
    from fsdp_ws1_vs_plain import PRESETS
    from plyx.dist._parallelize import apply_fsdp
    from plyx.model import TransformerLM
    from plyx.specs import ModelConfig
    from torch.distributed.device_mesh import init_device_mesh

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="1b")
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--out", default=str(_runs.RESULTS / "ws1_host_costs.jsonl"))
    args = p.parse_args()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        mesh = init_device_mesh("cpu", (1,))
        with torch.device("meta"):
            model = TransformerLM(ModelConfig(**PRESETS[args.preset].model, tie_embeddings=False))
        apply_fsdp(model, mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, reshard_after_forward=False,
                   shard_head=False)
        model.set_requires_gradient_sync(True)  # the first call pays for nothing the loop does not
        t0 = time.perf_counter()
        for _ in range(args.calls):
            model.set_requires_gradient_sync(True)
        us = 1e6 * (time.perf_counter() - t0) / args.calls
    finally:
        dist.destroy_process_group()
    row = {"bench": "ws1_host_costs", "preset": args.preset, "call": "set_requires_gradient_sync", "us_per_call": us,
           "modules": sum(1 for _ in model.modules()), "device": _runs.device_name(), "date": _runs.now()}
    print(f"set_requires_gradient_sync on the {args.preset} model ({row['modules']} modules): {us:.0f} us per call "
          f"({row['device']})")
    _runs.append(Path(args.out), [row])


if __name__ == "__main__":
    main()
