"""Compile every flash-attention variant for sm_90 (H100/H200) on any machine, no GPU needed.

Each kernel of each ``VARIANTS`` entry (forward, dK/dV, dQ; deduplicated: variants sharing a kernel's tile
and switches share its compile) is compiled as a real launch specialises it (16-byte aligned pointers,
16-divisible sizes and strides) for bf16 [B, T, H, Dh] inputs, causal and full. Per kernel: shared memory,
``wgmma`` and TMA (``cp.async.bulk.tensor``) instructions in the PTX, pointer async copies (``cp.async``),
registers and stack bytes (spills, from ``cuobjdump -res-usage``), or the compiler's error (a switch this
Triton build cannot lower, e.g. warp specialisation on Hopper). Exits 1 when a kernel fails to compile,
spills, misses wgmma, or a TMA variant has no TMA copy.

Usage::

    TRITON_INTERPRET=0 python packages/kernel/bench/attention/compile_flash_sm90.py [--head-dims 128 64]
        [--variants baseline tma ...] [--causal both|true|false] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ["TRITON_INTERPRET"] = "0"  # before the kernels are decorated: compiled, never interpreted

import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from compile_moe_sm90 import _res_usage, compile_for_sm90  # the MoE compile check's compile and cuobjdump reader

B, T, H, KV = 1, 4096, 16, 16  # strides and sizes of a 4k-token bf16 batch, as a launch would see them


def _strides(prefix: str, heads: int, d: int) -> dict[str, tuple[str, int]]:
    # [B, T, heads, d] contiguous
    return {f"stride_{prefix}b": ("i32", T * heads * d), f"stride_{prefix}{'t' if prefix in ('q', 'o', 'do', 'dq') else 's'}":
            ("i32", heads * d), f"stride_{prefix}h": ("i32", d)}


def _common(d: int) -> dict[str, tuple[str, int | None]]:
    args: dict[str, tuple[str, int | None]] = {}
    for p, heads in (("q", H), ("k", KV), ("v", KV), ("o", H), ("do", H), ("dq", H), ("dk", KV), ("dv", KV)):
        args.update(_strides(p, heads, d))
    args.update({f"stride_bias_{x}": ("i32", 0) for x in "bhts"})
    args.update(stride_docs_b=("i32", 0), T=("i32", T), S=("i32", T), H=("i32", H), KV=("i32", KV),
                N_BH=("i32", B * H), qk_scale=("fp32", None), sm_scale=("fp32", None), window=("i32", 0),
                TUNE_T=("i32", T), TUNE_S=("i32", T))
    for ptr in ("Q", "K", "V", "OUT", "DO", "DK", "DV", "BIAS", "DOCS"):
        args[ptr] = ("*bf16", None)
    for ptr in ("LSE2", "DELTA"):
        args[ptr] = ("*fp32", None)
    return args


def _record(label: str, build: Any) -> dict[str, Any]:
    try:
        kernel = build()
    except Exception as exc:  # a switch this Triton cannot lower: reported, not fatal to the others
        return {"kernel": label, "ok": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    ptx = kernel.asm["ptx"]
    regs, stack = _res_usage(kernel.asm["cubin"])
    return {"kernel": label, "shared": int(kernel.metadata.shared), "wgmma": ptx.count("wgmma.mma_async"),
            "tma": ptx.count("cp.async.bulk.tensor"), "cp_async": ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
            "registers": regs, "stack": stack}


def compile_variants(names: list[str], head_dims: list[int], causals: tuple[bool, ...] = (True, False)
                     ) -> list[dict[str, Any]]:
    """One record per distinct (kernel, tile, switches, head_dim, causal) of the ``names`` variants."""
    from plyx.kernel.attention import _flash as fl

    records: list[dict[str, Any]] = []
    seen: set[tuple[Any, ...]] = set()
    for d in head_dims:
        args = _common(d)
        for causal in causals:
            flags = dict(GROUP=H // KV, HEAD_DIM=d, CAUSAL=causal, HAS_WINDOW=False, HAS_DOCS=False, HAS_BIAS=False)
            for name in names:
                cfg = fl.VARIANTS[name]
                kernels = [
                    ("fwd", fl._attn_fwd, cfg.fwd, dict(TMA=cfg.tma, WS=cfg.warp_specialize,
                                                        PERSISTENT=cfg.persistent > 0, FOLD=cfg.fold_scale)),
                    ("dkdv", fl._attn_bwd_dkdv, cfg.dkdv, dict(TMA=cfg.tma, WS=False, ATOMIC_DQ=cfg.atomic_dq)),
                ]
                if not cfg.atomic_dq:
                    kernels.append(("dq", fl._attn_bwd_dq, cfg.dq, dict(TMA=cfg.tma, WS=cfg.warp_specialize)))
                for which, fn, tile, switches in kernels:
                    key = (which, tile, tuple(sorted(switches.items())), d, causal)
                    if key in seen:
                        continue
                    seen.add(key)
                    kargs = dict(args)
                    if which == "dkdv":  # dQ's float32 sums (atomic) or an unused pointer
                        kargs["DQ_ACC"] = ("*fp32", None)
                        kargs.update(stride_dqb=("i32", T * H * d), stride_dqt=("i32", H * d), stride_dqh=("i32", d))
                    if which == "dq":
                        kargs["DQ"] = ("*bf16", None)
                    ce = dict(flags, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, **switches)
                    on = [k for k, v in switches.items() if v]
                    label = (f"{which:4s} d{d} {'causal' if causal else 'full  '} {tile.block_m}x{tile.block_n} "
                             f"w{tile.num_warps} s{tile.num_stages} {'+'.join(on) or 'plain'} [{name}]")
                    rec = _record(label, lambda fn=fn, kargs=kargs, ce=ce, tile=tile: compile_for_sm90(fn, kargs, ce, tile.num_warps,
                                                                                           tile.num_stages))
                    rec.update(variant=name, which=which, head_dim=d, causal=causal, tile=list(tile), **switches)
                    if "error" not in rec:
                        rec["ok"] = rec["stack"] == 0 and rec["wgmma"] > 0 and (not switches.get("TMA") or rec["tma"] > 0)
                    records.append(rec)
                    _print(rec)
    return records


def _print(r: dict[str, Any]) -> None:
    if "error" in r:
        print(f"{r['kernel']:62s} FAILED TO COMPILE: {r['error']}", flush=True)
        return
    print(f"{r['kernel']:62s} shared {r['shared']:6d}  wgmma {r['wgmma']:3d}  tma {r['tma']:2d}  "
          f"cp.async {r['cp_async']:3d}  regs {r['registers']:3d}  stack {r['stack']:4d}  "
          f"{'ok' if r['ok'] else 'FAIL'}", flush=True)


def main() -> int:
    from plyx.kernel.attention._flash import VARIANTS

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--causal", choices=["both", "true", "false"], default="both")
    parser.add_argument("--out", type=Path, help="also write the records to DIR/compile-flash-sm90.json")
    a = parser.parse_args()
    causals = {"both": (True, False), "true": (True,), "false": (False,)}[a.causal]
    records = compile_variants(a.variants, a.head_dims, causals)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        tmp = a.out / "compile-flash-sm90.json.tmp"
        tmp.write_text(json.dumps({"target": "cuda sm_90", "triton": triton.__version__, "kernels": records},
                                  indent=1))
        tmp.replace(a.out / "compile-flash-sm90.json")
    failed = [r["kernel"] for r in records if not r["ok"]]
    print(f"{len(records) - len(failed)}/{len(records)} kernels ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
