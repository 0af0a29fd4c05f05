"""Compile the MoE kernels for sm_90 (H100) on any machine, no GPU needed: pipelined, on wgmma, no spills.

Each kernel is compiled as a real launch specialises it (16-byte aligned pointers, 16-divisible sizes and
strides, unit strides as the constant 1) at the tiles the layer picks on an H100 for OLMoE-1B-7B
(``grouped_gemm_tiles.json``; the fused SwiGLU forward halves the tuned 256-wide N tile into a gate and an
up accumulator). Per kernel: shared memory, ``wgmma`` and ``cp.async`` instructions in the PTX, registers
and stack bytes (spills) from ``cuobjdump -res-usage``. Exits 1 when a GEMM misses wgmma or the async
copies, or any kernel spills (the inference-only SwiGLU forward may keep 8 bytes on the stack).

Usage::

    TRITON_INTERPRET=0 python packages/kernel/bench/compile_moe_sm90.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ["TRITON_INTERPRET"] = "0"  # before the kernels are decorated: compiled, never interpreted

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)
BF16 = "*bf16"


def _res_usage(cubin: bytes) -> tuple[int, int]:
    """``(registers, stack bytes)`` of the kernel in ``cubin``, from the cuobjdump Triton bundles."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        out = subprocess.run([str(tool), "-res-usage", str(path)], capture_output=True, text=True, check=True).stdout
    regs, stack = re.search(r"REG:(\d+)", out), re.search(r"STACK:(\d+)", out)
    return int(regs.group(1)) if regs else -1, int(stack.group(1)) if stack else -1


def compile_for_sm90(fn: Any, args: dict[str, tuple[str, int | None]], constexprs: dict[str, Any], warps: int,
                     stages: int) -> Any:
    """``triton.compile`` of ``fn`` for sm_90 with ``args`` (name -> (type, value; None for pointers)) specialised
    as a launch does: every pointer and 16-divisible integer marked divisible by 16, an integer 1 a constant."""
    sig: dict[str, str] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    consts = dict(constexprs)
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        typ, value = args[name]
        if value == 1 and not typ.startswith("*"):  # Triton specialises an integer 1 into a constant
            sig[name] = "constexpr"
            consts[name] = 1
            continue
        sig[name] = typ
        if typ.startswith("*") or (value is not None and value % 16 == 0):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), target=TARGET,
                          options={"num_warps": warps, "num_stages": stages})


def compile_kernel(fn: Any, args: dict[str, tuple[str, int | None]], constexprs: dict[str, Any], warps: int,
                   stages: int, label: str, gemm: bool, allow_stack: int = 0) -> dict[str, Any]:
    """Compile ``fn`` as a launch with ``args`` (name -> (type, value; None for pointers)) specialises it;
    ``allow_stack``: stack bytes accepted (0: no spill at all).

    Returns:
        A record: label, shared bytes, wgmma / cp.async counts, registers, stack bytes, ok.
    """
    kernel = compile_for_sm90(fn, args, constexprs, warps, stages)
    ptx = kernel.asm["ptx"]
    regs, stack = _res_usage(kernel.asm["cubin"])
    wgmma = ptx.count("wgmma.mma_async")
    async_copies = ptx.count("cp.async.cg") + ptx.count("cp.async.ca")
    ok = 0 <= stack <= allow_stack and (not gemm or (wgmma > 0 and async_copies > 0))
    return {"kernel": label, "shared": int(kernel.metadata.shared), "wgmma": wgmma, "cp_async": async_copies,
            "registers": regs, "stack": stack, "ok": ok}


def grouped(bm: int, bn: int, bk: int, warps: int, stages: int, gather: bool, swiglu: bool, n: int, k: int,
            label: str, store_h: bool = True) -> dict[str, Any]:
    from plyx.kernel.triton_ops import grouped_gemm as gg

    args = dict(X=(BF16, None), W=(BF16, None), Y=(BF16, None), OFFS=("*i64", None), TILE_E=("*i32", None),
                TILE_ROW=("*i64", None), N=("i32", n), K=("i32", k), E=("i32", 64), GRID_M=("i32", 320),
                sxm=("i64", k), sxk=("i64", 1), swe=("i64", (2 if swiglu else 1) * n * k), swn=("i64", k),
                swk=("i64", 1), sym=("i64", (2 if swiglu else 1) * n), syn=("i64", 1), ROWS=("*i32", None),
                A=(BF16, None), sam=("i64", n), RSCALE=("*fp32", None), PART=("*fp32", None))
    ce = dict(UPCAST=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, TMA=0, GATHER=int(gather),
              SWIGLU=int(swiglu), COMBINE_GRAD=0, STORE_H=int(store_h))
    # without the halves' stores ptxas keeps 8 bytes on the stack (one 64-bit value; 255 registers), at every
    # tile and stage count tried (128x128 s3/s4, 64x128 w4): accepted for the inference-only variant
    return compile_kernel(gg._grouped_kernel, args, ce, warps, stages, label, gemm=True,
                          allow_stack=0 if store_h else 8)


def input_grad(bm: int, bn: int, bk: int, warps: int, stages: int, n: int, k: int, label: str,
               combine: bool = False) -> dict[str, Any]:
    """``dx = dy @ W_e``: W [E, N', K'] read through swapped strides (its unit stride on the output dim);
    ``combine``: dy gathered through the rows' tokens, scaled by their gate weights, the gate weights'
    gradient summed in the epilogue."""
    from plyx.kernel.triton_ops import grouped_gemm as gg

    args = dict(X=(BF16, None), W=(BF16, None), Y=(BF16, None), OFFS=("*i64", None), TILE_E=("*i32", None),
                TILE_ROW=("*i64", None), N=("i32", n), K=("i32", k), E=("i32", 64), GRID_M=("i32", 320),
                sxm=("i64", k), sxk=("i64", 1), swe=("i64", n * k), swn=("i64", 1), swk=("i64", n),
                sym=("i64", n), syn=("i64", 1), ROWS=("*i32", None), A=(BF16, None), sam=("i64", n),
                RSCALE=("*fp32", None), PART=("*fp32", None))
    ce = dict(UPCAST=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, TMA=0, GATHER=int(combine), SWIGLU=0,
              COMBINE_GRAD=int(combine), STORE_H=1)
    return compile_kernel(gg._grouped_kernel, args, ce, warps, stages, label, gemm=True)


def weight_grad(bm: int, bn: int, bk: int, warps: int, stages: int, gather: bool, n: int, k: int,
                label: str, gather_dy: bool = False) -> dict[str, Any]:
    from plyx.kernel.triton_ops import grouped_gemm as gg

    args = dict(DY=(BF16, None), X=(BF16, None), DW=(BF16, None), OFFS=("*i64", None), ROWS=("*i32", None),
                N=("i32", n), K=("i32", k), E=("i32", 64), ITEMS=("i32", 64 * 16), sdm=("i64", n), sdn=("i64", 1),
                sxm=("i64", k), sxk=("i64", 1), swe=("i64", n * k), swn=("i64", k), swk=("i64", 1),
                DY_ROWS=("*i32", None), DY_SCALE=("*fp32", None))
    ce = dict(UPCAST=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_N=8, EXPERT_MAJOR=True, SPLIT=1, TMA=False,
              PERSISTENT=False, FLATTEN=False, GATHER=int(gather), GATHER_DY=int(gather_dy))
    return compile_kernel(gg._weight_grad_kernel, args, ce, warps, stages, label, gemm=True)


def small_kernels() -> list[dict[str, Any]]:
    from plyx.kernel.triton_ops import grouped_gemm as gg
    from plyx.kernel.triton_ops import moe_permute as mp

    return [
        compile_kernel(mp._routing_kernel, dict(IDS=("*i64", None), POS=("*i64", None), OFFS=("*i64", None),
                                                TK=("i32", 32768)),
                       dict(BLOCK=1024), 4, 1, "routing sort (one program per expert)", gemm=False),
        compile_kernel(gg._tile_kernel, dict(OFFS=("*i64", None), TILE_E=("*i32", None), TILE_ROW=("*i64", None),
                                             E=("i32", 64), GRID_M=("i32", 320)),
                       dict(BLOCK_M=128, EP=64, BLOCK=gg.tile_table_block(64)), 4, 1, "tile table (64 experts)",
                       gemm=False),
        compile_kernel(gg._source_rows_kernel, dict(POS=("*i64", None), ROWS=("*i32", None), WEIGHTS=(BF16, None),
                                                    ROW_WEIGHTS=("*fp32", None), TK=("i32", 32768)),
                       dict(TOPK=8, BLOCK=1024, HAS_WEIGHTS=1), 4, 1, "source rows and gate weights (top-8)",
                       gemm=False),
        compile_kernel(gg._swiglu_grad_kernel, dict(DA=(BF16, None), H=(BF16, None), DH=(BF16, None),
                                                    M=("i32", 32768), F=("i32", 1024), sda=("i64", 1024),
                                                    sh=("i64", 2048), sdh=("i64", 2048)),
                       dict(BLOCK_R=16, BLOCK_F=256), 4, 1, "swiglu gradient", gemm=False),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="also write the records to DIR/compile-moe-sm90.json")
    args = parser.parse_args()
    d, f = 2048, 1024  # OLMoE-1B-7B: d_model, d_expert
    records = [
        grouped(128, 128, 64, 8, 4, True, True, f, d, "gate/up forward: gathered rows + SwiGLU, 128x(2x128)x64"),
        grouped(128, 128, 64, 8, 4, True, True, f, d, "the same, inference (the halves not stored)", store_h=False),
        grouped(128, 256, 64, 8, 4, False, False, d, f, "down forward 128x256x64"),
        input_grad(128, 256, 64, 8, 4, d, 2 * f, "gate/up input gradient 128x256x64"),
        input_grad(128, 128, 64, 8, 4, f, d, "down input gradient + combine grad (gathered dout) 128x128x64",
                   combine=True),
        weight_grad(64, 128, 256, 8, 3, True, 2 * f, d, "gate/up weight gradient, gathered x, 64x128x256"),
        weight_grad(64, 128, 256, 8, 3, False, d, f, "down weight gradient, gathered scaled dout, 64x128x256",
                    gather_dy=True),
        weight_grad(64, 128, 256, 8, 3, False, d, f, "plain weight gradient 64x128x256"),
        *small_kernels(),
    ]
    for r in records:
        print(f"{r['kernel']:58s} shared {r['shared']:6d}  wgmma {r['wgmma']:2d}  cp.async {r['cp_async']:3d}  "
              f"regs {r['registers']:3d}  stack {r['stack']:4d}  {'ok' if r['ok'] else 'FAIL'}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        tmp = args.out / "compile-moe-sm90.json.tmp"
        tmp.write_text(json.dumps({"target": "cuda sm_90", "triton": triton.__version__, "kernels": records}, indent=1))
        tmp.replace(args.out / "compile-moe-sm90.json")
    return 0 if all(r["ok"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
