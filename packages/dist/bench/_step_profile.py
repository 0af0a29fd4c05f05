"""``torch.profiler`` over a few steps of a ``plyx train`` run, and the side-by-side summary of two runs.

Two halves:

- ``install(out, start, steps)`` (inside the training process, from ``_kernel_trace.py``): a plugin on
  ``plyx_on_train_step_end`` opens a profiler when step ``start`` has been reported and closes it
  ``steps`` reports later, synchronising the device at both ends so the window holds the device work of
  exactly ``steps`` steps; it writes the window's kernels and ops to ``out`` (JSON).
- ``compare(a, b)`` (in the benchmark): groups each run's kernel time by kind (GEMM, attention,
  elementwise/copy, norm, loss, optimizer, collective, memcpy/memset, other), counts kernel launches,
  takes the host time per step, and ranks kernels and ops by the difference between the runs.

On CUDA a "kernel" is a device activity (a CUDA kernel, memcpy or memset: CUPTI's records); on CPU, where
no device records exist, it is an ``aten::``/``plyx::``/``c10d::`` op with its self CPU time (the time
outside the ops it calls, so nothing is counted twice), which is what runs the arithmetic there.
The device-side spans of ``record_function`` ranges (``FSDP::pre_forward (layers.3)``, the optimizer's
``Optimizer.step#AdamW.step``) are kept apart (``annotations``): they cover kernels already counted, and
counting them as kernels put +15.5 ms per step of phantom "elementwise/copy" time on the FSDP side of the
H100 profile of 2026-11-24 (``device_kernels`` drops them from profiles written before).

``python _step_profile.py PROFILE.json [OUT.txt]`` prints (and writes) a stored profile's comparisons again
with the current accounting.

``install_clock(out, start, stop)`` is the cheap half: wall and process CPU time at every reported step
from ``start`` to ``stop``, the device synchronised at both ends, written at exit: the timed window of the
benchmark (warm-up and autotuning before ``start``) and a CPU time per step that other processes on a
shared machine do not inflate (wall time does).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from plyx.specs import hookimpl

__all__ = ["KINDS", "install", "install_clock", "clock_per_step", "classify", "compare", "device_kernels",
           "format_compare"]

# the order of the rules matters: the first that matches names the kind
_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("collective", re.compile(r"nccl|gloo|c10d|all_?gather|reduce_?scatter|all_?reduce|broadcast|_allgather_base"
                              r"|_reduce_scatter_base|foreach_all_gather|foreach_reduce", re.I)),
    ("memcpy/memset", re.compile(r"memcpy|memset", re.I)),
    ("optimizer", re.compile(r"adam|_foreach_|multi_tensor|fused_sgd|optimizer|clip_grad", re.I)),
    ("attention", re.compile(r"attn|attention|flash|fmha|sdpa", re.I)),
    ("norm", re.compile(r"rms_?norm|layer_?norm|native_norm|\bnorm\b", re.I)),
    ("loss", re.compile(r"cross_entropy|_ce_|nll_loss|log_softmax|logsumexp|_linear_ce", re.I)),
    ("GEMM", re.compile(r"gemm|gemv|cutlass|cublas|nvjet|xmma|sm90_|sm80_|ampere_|\b(aten::)?(mm|addmm|bmm|baddbmm"
                        r"|matmul|linear|_addmm_activation|mkldnn_\w*mm)\b", re.I)),
)
KINDS = ("GEMM", "attention", "elementwise/copy", "norm", "loss", "optimizer", "collective", "memcpy/memset")


def classify(name: str) -> str:
    """The kind of a kernel or op name (``KINDS``); anything unmatched is elementwise/copy work."""
    for kind, pattern in _RULES:
        if pattern.search(name):
            return kind
    return "elementwise/copy"


# -- inside the training process ---------------------------------------------------------------------------
def _summarise(prof: Any, steps: int, wall_s: float, cpu_s: float, cuda: bool) -> dict[str, Any]:
    """The profile of ``steps`` steps as plain numbers: kernels by name and ops by name."""
    from torch.autograd import DeviceType

    kernels: dict[str, list[float]] = {}  # name -> [launches, device us]
    ops: dict[str, list[float]] = {}  # name -> [calls, self cpu us]
    annotations: dict[str, list[float]] = {}  # name -> [ranges, device us]: spans over kernels, not kernels
    host_us = 0.0
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            # a record_function range (FSDP::pre_forward (layers.3), Optimizer.step#AdamW.step) also appears on
            # the device timeline, spanning the kernels it launched: counted as a kernel it counts them twice
            table = annotations if getattr(e, "is_user_annotation", False) else kernels
            k = table.setdefault(e.name, [0, 0.0])
            k[0] += 1
            k[1] += e.time_range.elapsed_us()
            continue
        o = ops.setdefault(e.name, [0, 0.0])
        o[0] += 1
        o[1] += e.self_cpu_time_total
        if not cuda and re.match(r"(aten|plyx|c10d|gloo)::", e.name):  # self time: no double counting
            k = kernels.setdefault(e.name, [0, 0.0])
            k[0] += 1
            k[1] += e.self_cpu_time_total
        if "Synchronize" not in e.name:  # waiting for the device is not host work
            host_us += e.self_cpu_time_total
    return {"steps": steps, "cuda": cuda, "wall_ms_per_step": 1e3 * wall_s / steps,
            "process_cpu_ms_per_step": 1e3 * cpu_s / steps, "op_cpu_ms_per_step": host_us / 1e3 / steps,
            "kernels": kernels, "ops": ops, "annotations": annotations}


class _Profiler:
    """The ``plyx_on_train_step_end`` plugin that profiles reports ``start + 1 .. start + steps``."""

    plyx_contracts = {"hooks": "1.0"}

    def __init__(self, out: Path, start: int, steps: int) -> None:
        self.out, self.start, self.steps = out, start, steps
        self.prof: Any = None
        self.t0 = self.c0 = 0.0

    def _sync(self) -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()

    @hookimpl
    def plyx_on_train_step_end(self, step: int, metrics: dict[str, float]) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        if step == self.start and self.prof is None:
            self._sync()
            cuda = torch.cuda.is_available()
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            self.prof = profile(activities=acts, record_shapes=False, with_stack=False)
            self.prof.__enter__()
            self.t0, self.c0 = time.perf_counter(), time.process_time()
        elif step == self.start + self.steps and self.prof is not None:
            self._sync()
            wall, cpu = time.perf_counter() - self.t0, time.process_time() - self.c0
            self.prof.__exit__(None, None, None)
            doc = _summarise(self.prof, self.steps, wall, cpu, torch.cuda.is_available())
            tmp = self.out.with_suffix(".tmp")
            tmp.write_text(json.dumps(doc) + "\n", encoding="utf-8")
            os.replace(tmp, self.out)
            self.prof = None


def install(out: Path, start: int, steps: int) -> None:
    """Profile the steps reported after ``start`` (``steps`` of them) into ``out``, rank 0 only."""
    from plyx.specs.plugins import register_plugin

    register_plugin(_Profiler(out, start, steps), "bench-step-profile", distribution="plyx-dist bench")


class _Clock:
    """The ``plyx_on_train_step_end`` plugin that stamps wall and process CPU time at the steps ``start..stop``.

    At ``start`` and ``stop`` it waits for the device first (``torch.cuda.synchronize``), so the wall time
    between them is the device's time for those steps, not the host's time to queue them; in between it
    only stamps (a sync per step would stop the host from running ahead, which is part of what is measured).
    Both ends are reported at the same point of a step (``stop`` is not the run's last step, which the
    Trainer reports after its loop when it reads stats a step late), so exactly ``stop - start`` steps lie
    between them.
    """

    plyx_contracts = {"hooks": "1.0"}

    def __init__(self, out: Path, start: int, stop: int) -> None:
        self.out, self.start, self.stop = out, start, stop
        self.stamps: list[tuple[int, float, float]] = []

    @hookimpl
    def plyx_on_train_step_end(self, step: int, metrics: dict[str, float]) -> None:
        if self.start <= step <= self.stop:
            if step in (self.start, self.stop):
                import torch

                if torch.cuda.is_available():
                    torch.cuda.synchronize()
            self.stamps.append((step, time.perf_counter(), time.process_time()))

    def write(self) -> None:
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.stamps) + "\n", encoding="utf-8")
        os.replace(tmp, self.out)


def install_clock(out: Path, start: int, stop: int) -> None:
    """Stamp the steps ``start..stop`` into ``out`` (JSON ``[[step, wall_s, cpu_s], ...]``) at exit, the device
    synchronised at both ends (``_Clock``)."""
    import atexit

    from plyx.specs.plugins import register_plugin

    clock = _Clock(out, start, stop)
    register_plugin(clock, "bench-step-clock", distribution="plyx-dist bench")
    atexit.register(clock.write)


def clock_per_step(stamps: list[list[float]]) -> dict[str, float]:
    """``{"wall_ms_per_step", "cpu_ms_per_step"}`` between the first and the last stamp."""
    if len(stamps) < 2:
        raise ValueError(f"{len(stamps)} step stamps: the run needs at least two steps after the warm-up "
                         f"(raise --steps)")
    (s0, w0, c0), (s1, w1, c1) = stamps[0], stamps[-1]
    n = max(s1 - s0, 1)
    return {"wall_ms_per_step": 1e3 * (w1 - w0) / n, "cpu_ms_per_step": 1e3 * (c1 - c0) / n}


# -- in the benchmark -------------------------------------------------------------------------------------
def device_kernels(profile: dict[str, Any]) -> dict[str, list[float]]:
    """A profile's kernels without the device-side spans of ``record_function`` ranges.

    Profiles written before the annotations were kept apart (plyx-dist < 1.4, e.g. the H100 profile of
    2026-11-24) list ``FSDP::pre_forward (layers.3)`` or ``Optimizer.step#AdamW.step`` among the kernels:
    on CUDA such a name is also a host op (the range itself), which no kernel name is, so it is dropped.
    """
    kernels = profile["kernels"]
    if not profile.get("cuda"):
        return kernels
    return {name: v for name, v in kernels.items() if name not in profile["ops"]}


def _by_kind(kernels: dict[str, list[float]], steps: int) -> dict[str, list[float]]:
    out = {k: [0.0, 0.0] for k in (*KINDS, "total")}
    for name, (count, us) in kernels.items():
        for key in (classify(name), "total"):
            out[key][0] += count / steps
            out[key][1] += us / 1e3 / steps
    return out  # kind -> [launches per step, ms per step]


def _diff(a: dict[str, list[float]], b: dict[str, list[float]], steps_a: int, steps_b: int, col: int,
          top: int) -> list[dict[str, Any]]:
    rows = []
    for name in set(a) | set(b):
        va, vb = a.get(name, [0, 0.0]), b.get(name, [0, 0.0])
        ms_a, ms_b = va[col] / 1e3 / steps_a, vb[col] / 1e3 / steps_b
        rows.append({"name": name, "kind": classify(name), "a_ms": ms_a, "b_ms": ms_b, "diff_ms": ms_b - ms_a,
                     "a_calls": va[0] / steps_a, "b_calls": vb[0] / steps_b})
    rows.sort(key=lambda r: -abs(r["diff_ms"]))
    return rows[:top]


def compare(a: dict[str, Any], b: dict[str, Any], *, top: int = 15) -> dict[str, Any]:
    """Path ``b`` against path ``a``, per step: kernel time and launches by kind, host time, top differences.

    Args:
        a, b: two profiles written by ``install`` (the plain path first).
        top: how many kernels and ops to list by absolute difference.
    Returns:
        ``{"kinds": {kind: {"a_ms", "b_ms", "a_launches", "b_launches"}}, "host": {...}, "top_kernels": [...],
        "top_ops": [...]}``, every figure per step.
    """
    kern_a, kern_b = device_kernels(a), device_kernels(b)
    ka, kb = _by_kind(kern_a, a["steps"]), _by_kind(kern_b, b["steps"])
    kinds = {k: {"a_ms": ka[k][1], "b_ms": kb[k][1], "a_launches": ka[k][0], "b_launches": kb[k][0]} for k in ka}
    host = {key: {"a": a[key], "b": b[key]}
            for key in ("wall_ms_per_step", "process_cpu_ms_per_step", "op_cpu_ms_per_step")}
    return {"kinds": kinds, "host": host,
            "top_kernels": _diff(kern_a, kern_b, a["steps"], b["steps"], 1, top),
            "top_ops": _diff(a["ops"], b["ops"], a["steps"], b["steps"], 1, top)}


def _short(name: str, width: int) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def format_compare(cmp: dict[str, Any], names: Iterable[str] = ("plain", "fsdp"), *, cuda: bool) -> str:
    """The comparison as a text table (per step)."""
    na, nb = names
    unit = "kernel" if cuda else "op self-CPU"
    w = max(10, len(na) + 3, len(nb) + 3) + 1  # a column fits the longer path name
    lines = [f"{unit} time per step by kind (a = {na}, b = {nb})",
             f"  {'':<32}{'a ms':>{w}}{'b ms':>{w}}{'b - a':>9}{'a launches':>{w + 2}}{'b launches':>{w + 2}}"]
    for kind, v in cmp["kinds"].items():
        lines.append(f"  {kind:<32}{v['a_ms']:>{w}.2f}{v['b_ms']:>{w}.2f}{v['b_ms'] - v['a_ms']:>+9.2f}"
                     f"{v['a_launches']:>{w + 2}.0f}{v['b_launches']:>{w + 2}.0f}")
    lines.append("host per step (ms)")
    for key, v in cmp["host"].items():
        lines.append(f"  {key:<32}{v['a']:>{w}.2f}{v['b']:>{w}.2f}{v['b'] - v['a']:>+9.2f}")
    for title, rows in ((f"top {unit}s by difference (ms per step: a, b, b - a; calls per step a/b)",
                         cmp["top_kernels"]),
                        ("top ops by self-CPU difference (ms per step: a, b, b - a; calls per step a/b)",
                         cmp["top_ops"])):
        lines.append(title)
        for r in rows:
            lines.append(f"  {_short(r['name'], 52):<54}{r['a_ms']:>9.3f}{r['b_ms']:>9.3f}{r['diff_ms']:>+9.3f}"
                         f"  n {r['a_calls']:.0f}/{r['b_calls']:.0f}  [{r['kind']}]")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Re-print a stored ``fsdp_ws1_profile-*.json``'s comparisons with this module's accounting."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python _step_profile.py PROFILE.json [OUT.txt]", file=sys.stderr)
        return 2
    doc = json.loads(Path(args[0]).read_text(encoding="utf-8"))
    profiles, texts = doc["profiles"], []
    for pair in doc["comparisons"]:
        a, b = pair.split(":")
        cmp = compare(profiles[a], profiles[b])
        texts.append(f"== {b} against {a}: {doc['steps']} steps after {doc['warmup']} (preset {doc['preset']}, batch "
                     f"{doc.get('batch', '?')}, {doc['device']}, {doc['date']}), device-side record_function spans "
                     f"excluded\n" + format_compare(cmp, (a, b), cuda=bool(profiles[a].get("cuda"))))
    text = "\n".join(texts)
    print(text)
    if len(args) > 1:
        out = Path(args[1])
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(text + "\n", encoding="utf-8")
        os.replace(tmp, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
