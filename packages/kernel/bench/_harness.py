"""Timing, memory and ceilings shared by every kernel benchmark (CUDA only)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

__all__ = ["Case", "Result", "ceilings", "measure", "print_table"]


@dataclass
class Case:
    """One kernel at one shape: inputs, the providers to compare and the floor of each mode.

    ``providers`` maps a name (plyx, torch, torch.compile, liger) to a builder that takes the
    inputs and returns a forward callable; ``grad`` names the inputs differentiated in fwd+bwd.
    ``floor`` maps a mode to ("bytes" | "flops", amount): the work no implementation can avoid.
    """

    kernel: str
    shape: str
    inputs: Callable[[], dict[str, torch.Tensor]]
    providers: dict[str, Callable[[dict[str, torch.Tensor]], Callable[[], Any]]]
    grad: tuple[str, ...]
    floor: dict[str, tuple[str, float]]
    fwd_no_grad: bool = True
    graph: bool = True  # also time from a CUDA graph (only for runs under GRAPH_BELOW_MS: launch-bound sizes)


@dataclass
class Result:
    kernel: str
    shape: str
    provider: str
    mode: str
    ms: float | None = None  # eager: launches from Python included, as a training step runs them
    graph_ms: float | None = None  # the same work replayed from a CUDA graph: GPU time alone (None: not capturable)
    floor_ms: float | None = None
    rate: float | None = None  # GB/s or TFLOP/s
    rate_unit: str = ""
    peak_extra_mib: float | None = None
    error: str = ""
    ratios: dict[str, float] = field(default_factory=dict)  # peer -> peer_ms / ms (>1: plyx faster)


#: eager runs shorter than this are also timed from a CUDA graph, where Python's launch cost disappears
GRAPH_BELOW_MS = 2.0


def _bench(fn: Callable[[], Any]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _bench_graph(fn: Callable[[], Any]) -> float | None:
    """Median GPU time of ``fn`` replayed from a CUDA graph; None when it cannot be captured (host syncs)."""
    from triton.testing import do_bench_cudagraph

    try:
        return float(do_bench_cudagraph(fn, rep=100, return_mode="median"))
    except Exception:  # capture refuses host synchronisation and some allocations: report eager time only
        torch.cuda.synchronize()
        return None


def ceilings() -> dict[str, float]:
    """Measured copy bandwidth (GB/s) and cuBLAS bf16 matmul throughput (TFLOP/s) of this device."""
    from shapes import COPY_ELEMENTS

    x = torch.randn(COPY_ELEMENTS, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    copy_gbps = 2 * x.numel() * 2 / _bench(lambda x=x, y=y: y.copy_(x)) / 1e6
    del x, y
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    tflops = 2 * 8192**3 / _bench(lambda a=a, b=b: a @ b) / 1e9
    del a, b
    torch.cuda.empty_cache()
    return {"copy_GBps": copy_gbps, "bf16_matmul_TFLOPs": tflops}


def _floats(out: Any) -> list[torch.Tensor]:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [o for o in outs if isinstance(o, torch.Tensor) and o.is_floating_point() and o.requires_grad]


def measure(case: Case, ceil: dict[str, float], deadline: float) -> list[Result]:
    results: list[Result] = []
    inputs = case.inputs()
    for provider, build in case.providers.items():
        for mode in ("fwd", "fwd+bwd"):
            r = Result(case.kernel, case.shape, provider, mode)
            results.append(r)
            if time.time() > deadline:
                r.error = "skipped: benchmark time budget spent"
                continue
            try:
                fn = build(inputs)
                # a provider that works on its own copy of an input names it (Liger's CE overwrites its logits)
                grads = getattr(fn, "grad_inputs", None) or [inputs[n] for n in case.grad]
                if mode == "fwd":
                    if case.fwd_no_grad:
                        def run(fn: Callable[[], Any] = fn) -> Any:
                            with torch.no_grad():
                                return fn()
                    else:
                        run = fn
                else:
                    out = _floats(fn())
                    cot = [torch.randn_like(o) for o in out]
                    del out

                    def run(fn: Callable[[], Any] = fn, grads: list[torch.Tensor] = grads,
                            cot: list[torch.Tensor] = cot) -> Any:
                        return torch.autograd.grad(_floats(fn()), grads, cot)
                run()  # compile / autotune outside the timing
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                keep = run()
                torch.cuda.synchronize()
                r.peak_extra_mib = (torch.cuda.max_memory_allocated() - base) / 2**20
                del keep
                r.ms = _bench(run)
                if case.graph and r.ms < GRAPH_BELOW_MS:
                    r.graph_ms = _bench_graph(run)
                kind, amount = case.floor[mode]
                if kind == "bytes":
                    r.rate, r.rate_unit = amount / r.ms / 1e6, "GB/s"
                    r.floor_ms = amount / ceil["copy_GBps"] / 1e6
                else:
                    r.rate, r.rate_unit = amount / r.ms / 1e9, "TFLOP/s"
                    r.floor_ms = amount / ceil["bf16_matmul_TFLOPs"] / 1e9
            except Exception as exc:  # a peer may not support a shape or run out of memory: recorded, not fatal
                r.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
            finally:
                torch.cuda.empty_cache()
    del inputs
    torch.cuda.empty_cache()
    for r in results:
        if r.provider.startswith("plyx") and r.ms:
            for peer in results:
                if peer.mode == r.mode and not peer.provider.startswith("plyx") and peer.ms:
                    r.ratios[peer.provider] = peer.ms / r.ms
    return results


def print_table(results: list[Result]) -> str:
    lines = [f"{'kernel':<22}{'shape':<26}{'provider':<22}{'mode':<9}{'ms':>9}{'graph ms':>9}{'floor':>9}{'rate':>16}"
             f"{'peak MiB':>10}  vs peers (peer ms / plyx ms, eager)"]
    for r in results:
        if r.error:
            lines.append(f"{r.kernel:<22}{r.shape:<26}{r.provider:<22}{r.mode:<9}  {r.error}")
            continue
        ratios = " ".join(f"{k}={v:.2f}x" for k, v in r.ratios.items())
        graph = f"{r.graph_ms:>9.3f}" if r.graph_ms else f"{'-':>9}"
        lines.append(f"{r.kernel:<22}{r.shape:<26}{r.provider:<22}{r.mode:<9}{r.ms:>9.3f}{graph}{r.floor_ms:>9.3f}"
                     f"{r.rate:>10.1f} {r.rate_unit:<6}{r.peak_extra_mib:>9.0f}  {ratios}")
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def dump(path: Any, meta: dict[str, Any], results: list[Result]) -> None:
    path.write_text(json.dumps({**meta, "results": [asdict(r) for r in results]}, indent=1))
