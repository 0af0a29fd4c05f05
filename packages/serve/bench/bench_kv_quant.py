"""Quantised KV cache (``kv_cache_dtype`` int8 / fp8_e4m3) against the unquantised cache, same run.

Three measurements, each written to ``bench/results/kv-quant-<device>.jsonl`` (one JSON line per row, with the
device, the date and the versions) and printed as a table:

``quality``: a char-level model trained here on the first 90% of Tiny Shakespeare (plyx-train's copy of
the text, read from this checkout), evaluated on the held-out last 10% at two context lengths. Each window of ``ctx`` characters is
fed through the cache in chunks of ``--chunk`` tokens (<= 16: every token attends through the paged
decode kernel, i.e. through the quantised pools), so token t's logits see the quantised keys and values of
all tokens before it. Reported per cache dtype: perplexity and its delta against the unquantised cache,
teacher-forced top-1 agreement (argmax equal to the unquantised run's), and free-running greedy agreement:
``--gen`` tokens generated from a held-out prompt, the share equal to the unquantised run's and the length
of the common prefix.

``kernel``: one layer's decode attention at long context (the speed model's heads), ``paged_attention`` over
bf16 pools against ``paged_attention_quant`` over int8 / fp8 pools. ``us``: the kernels' own time, median of
CUDA-event timings of ten calls captured in a CUDA graph (what a graph-captured decode step pays);
``eager_us``: events around each Python call (launch overhead included: below ~200 us the GPU waits on the
host, which hid the kernels' differences in the first H100 run); with the pool bytes read per second.
``--sweep`` adds the quantised kernel at every ``SWEEP_CONFIGS`` launch config and split count
(mode ``kernel-sweep``).

``speed``: decode throughput at long context with ``plyx.serve``'s engine (CUDA graphs on a GPU): a random
model of a Llama shape, ``--batch`` prompts of ``--context`` random tokens, ``--new-tokens`` greedy tokens.
``decode_tok_s`` = batch * (new_tokens - 1) / (t(new_tokens) - t(1)): the prefill and the first token cancel,
but the decodes of early rows that overlap later prompts' prefill are in it. ``steady_tok_s``: the timed
run's tokens after every prompt is cached (the batch decodes alone) over that time. ``graphs``: whether the
decode steps replayed captured graphs (``captured``) or fell back to eager steps after a failed capture (the
warning is printed). ``--profile STEPS``: ``torch.profiler`` over STEPS steady engine steps of a further run
per cache dtype; the kernel table (by self device time) is printed and written to
``kv-quant-<device>-profile-<dtype>.txt`` beside the results.

    # CPU, tiny (the proof that the script runs; minutes):
    python packages/serve/bench/bench_kv_quant.py --preset cpu
    # GPU (bf16; fp8_e4m3 rows on Hopper only), each under 3 minutes on an H100:
    python packages/serve/bench/bench_kv_quant.py --preset gpu --mode kernel --sweep --out $OUT
    python packages/serve/bench/bench_kv_quant.py --preset gpu --mode speed --profile 4 --out $OUT
    # (--kv-dtypes int8 or fp8_e4m3 runs one quantised dtype beside the baseline, to split a long run)

Sizes live in PRESETS, never inline.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import math
import os
import platform
import re
import time
import warnings
from pathlib import Path

import torch

PRESETS = {
    # 2-core CI box: a small model trained for a few hundred steps, contexts 128 and 512
    "cpu": dict(quality_model=dict(d_model=96, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=256),
                train_steps=250, train_batch=8, train_len=256, lr=3e-3, contexts=(128, 512), windows=4, chunk=16,
                gen=48, speed_model="tiny", context=512, batch=2, new_tokens=17, dtype="float32",
                kernel_contexts=(512,), kernel_batches=(1, 4), sweep_shapes=((512, 4),)),
    # one H100/H200: head_dim 64 (the Triton kernels' sizes), trained at the longest context evaluated
    "gpu": dict(quality_model=dict(d_model=512, n_layers=8, n_heads=8, n_kv_heads=2, d_ff=1536),
                train_steps=400, train_batch=4, train_len=8192, lr=1e-3, contexts=(2048, 8192), windows=4, chunk=16,
                gen=128, speed_model="1.1b", context=8192, batch=16, new_tokens=257, dtype="bfloat16",
                kernel_contexts=(8192, 32768), kernel_batches=(1, 16, 64),
                sweep_shapes=((8192, 16), (32768, 16), (8192, 64))),
}

#: random-weight models of the speed test (Llama shapes)
SPEED_MODELS = {
    "tiny": dict(vocab_size=512, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=256),
    # TinyLlama 1.1B's shape: 22 layers, GQA 32/4, head_dim 64
    "1.1b": dict(vocab_size=32000, d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, d_ff=5632),
}

KV_DTYPES = ("auto", "int8", "fp8_e4m3")
#: the cache dtypes of this run (``--kv-dtypes``; ``auto``, the baseline of every speedup, always runs)
SELECTED = list(KV_DTYPES)


def _kv_dtypes(device: torch.device) -> list[str]:
    """The cache dtypes this device runs (fp8_e4m3: CPU or Hopper)."""
    from plyx.attn import check_kv_cache_dtype

    out = []
    for kv in KV_DTYPES:
        if kv not in SELECTED and kv != "auto":
            continue
        try:
            if kv != "auto":
                check_kv_cache_dtype(kv, device)
            out.append(kv)
        except ValueError as exc:
            print(f"skipping {kv}: {exc}")
    return out


#: plyx-train's copy of Tiny Shakespeare, read from the checkout (a GPU machine has the tree, maybe not plyx-train)
TEXT = Path(__file__).resolve().parents[3] / "packages" / "train" / "src" / "plyx" / "train" / "data" / "tinyshakespeare.txt"


def _text() -> str:
    return TEXT.read_text(encoding="utf-8")


def _model(config: dict, vocab: int, max_seq_len: int, device: torch.device, dtype: torch.dtype, seed: int = 0):
    from plyx.model import TransformerLM
    from plyx.specs import ModelConfig

    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=vocab, max_seq_len=max_seq_len, **config)
    with torch.device(device):  # initialised where it runs: a 1B model's float32 init on the host takes minutes
        return TransformerLM(cfg).to(dtype=dtype)


def train_char_model(p: dict, device: torch.device, steps: int | None = None):
    """A char-level TransformerLM trained on the first 90% of Tiny Shakespeare; returns (model, held-out ids)."""
    import torch.nn.functional as F
    from tqdm import tqdm

    text = _text()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    split = int(0.9 * len(data))
    train, held = data[:split], data[split:]
    max_ctx = max(p["contexts"])
    model = _model(p["quality_model"], len(chars), max(max_ctx, p["train_len"]) + p["gen"] + 16, device,
                   torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=p["lr"], weight_decay=0.1, betas=(0.9, 0.95))
    steps = p["train_steps"] if steps is None else steps
    gen = torch.Generator().manual_seed(0)
    model.train()
    bar = tqdm(range(steps), desc="train", leave=False, mininterval=5)
    for step in bar:
        lr = p["lr"] * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / steps))  # warmup + cosine
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(train) - p["train_len"] - 1, (p["train_batch"],), generator=gen)
        x = torch.stack([train[s:s + p["train_len"]] for s in starts.tolist()]).to(device)
        y = torch.stack([train[s + 1:s + 1 + p["train_len"]] for s in starts.tolist()]).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 25 == 0 or step == steps - 1:  # a loss read is a device sync: not every step
            bar.set_postfix(loss=f"{loss.item():.3f}")
    print(f"trained {steps} steps, last loss {loss.item():.3f}")
    return model.eval(), held


def _cache(kind: str, model, batch: int, max_len: int):
    from plyx.attn import make_cache

    name = {"auto": "paged", "int8": "paged_int8", "fp8_e4m3": "paged_fp8_e4m3"}[kind]
    param = next(model.parameters())  # the cache in the model's dtype (bf16 on a GPU), as the engine builds it
    return make_cache(name, model.config, batch_size=batch, block_size=16, max_seq_len=max_len, device=param.device,
                      dtype=param.dtype)


@torch.no_grad()
def teacher_forced(model, ids: torch.Tensor, kind: str, chunk: int) -> torch.Tensor:
    """Logits ``[B, T, V]`` of ``ids [B, T]`` fed through a fresh cache of ``kind`` ``chunk`` tokens at a time."""
    cache = _cache(kind, model, ids.shape[0], ids.shape[1])
    return torch.cat([model(ids[:, s:s + chunk], cache=cache).float() for s in range(0, ids.shape[1], chunk)], 1)


@torch.no_grad()
def greedy(model, prompt: torch.Tensor, kind: str, steps: int, chunk: int) -> torch.Tensor:
    """``steps`` greedy tokens after ``prompt [B, T]`` (prompt fed in chunks), one forward per token."""
    cache = _cache(kind, model, prompt.shape[0], prompt.shape[1] + steps)
    for s in range(0, prompt.shape[1], chunk):
        logits = model(prompt[:, s:s + chunk], cache=cache)
    out = []
    for _ in range(steps):
        nxt = logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        out.append(nxt)
        logits = model(nxt, cache=cache)
    return torch.cat(out, 1)


def quality(p: dict, device: torch.device, dtype: torch.dtype, train_steps: int | None = None) -> list[dict]:
    import torch.nn.functional as F

    model, held = train_char_model(p, device, train_steps)
    model = model.to(dtype)
    kinds = _kv_dtypes(device)
    rows = []
    for ctx in p["contexts"]:
        n = p["windows"]
        stride = (len(held) - ctx - p["gen"] - 1) // max(n - 1, 1)
        starts = [i * stride for i in range(n)]
        x = torch.stack([held[s:s + ctx] for s in starts]).to(device)  # (n, ctx)
        y = torch.stack([held[s + 1:s + ctx + 1] for s in starts]).to(device)
        logits = {k: teacher_forced(model, x, k, p["chunk"]) for k in kinds}
        prompt_len = ctx - p["gen"]
        gens = {k: greedy(model, x[:, :prompt_len], k, p["gen"], p["chunk"]) for k in kinds}
        base_nll = F.cross_entropy(logits["auto"].flatten(0, 1), y.flatten()).item()
        for k in kinds:
            nll = F.cross_entropy(logits[k].flatten(0, 1), y.flatten()).item()
            same = (gens[k] == gens["auto"])  # (n, gen)
            prefix = same.long().cumprod(1).sum(1).float().mean().item()
            rows.append(dict(
                mode="quality", kv_cache_dtype=k, context=ctx, windows=n, tokens=n * ctx,
                ppl=round(math.exp(nll), 4), ppl_delta=round(math.exp(nll) - math.exp(base_nll), 4),
                ppl_delta_pct=round(100 * (math.exp(nll - base_nll) - 1), 3),
                top1_agreement=round((logits[k].argmax(-1) == logits["auto"].argmax(-1)).float().mean().item(), 4),
                greedy_agreement=round(same.float().mean().item(), 4), greedy_common_prefix=round(prefix, 1),
                greedy_tokens=p["gen"],
            ))
    return rows


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _engine(model, kind: str, ctx: int, batch: int, new_tokens: int, cuda_graphs: bool):
    from plyx.serve.engine import Engine, EngineConfig

    cfg = EngineConfig(max_batch_size=batch, max_batch_tokens=2048, block_size=16,
                       max_model_len=ctx + new_tokens + 16, prefix_caching=False, kv_cache_dtype=kind,
                       cuda_graphs=cuda_graphs)
    return Engine(model, config=cfg)


def _run(engine, prompts: list[list[int]], new_tokens: int, device: torch.device, profile: dict | None = None
         ) -> dict:
    """Every prompt to completion through ``engine.step()``; wall seconds of the whole run and of its steady
    decode: from the step after which every request has its first token (every prompt is in the cache, so
    the batch decodes alone) to the end, with the tokens generated meanwhile.

    ``profile`` (``{"steps": n}``): the first ``n`` steady steps run under ``torch.profiler`` (CPU and CUDA
    activity); the profiler object is put back at ``profile["prof"]`` and those steps are not timed.
    """
    from plyx.serve import SamplingParams

    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    tag = f"r{next(_RUNS)}-"
    reqs = [engine.add_request(f"{tag}{i}", p, params) for i, p in enumerate(prompts)]
    _sync(device)
    start = time.perf_counter()
    while any(r.first_token_time is None for r in reqs):
        engine.step()
    if profile is not None:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        _sync(device)
        with torch_profile(activities=acts) as prof:
            for _ in range(profile["steps"]):
                if not any(not r.finished for r in reqs):
                    break
                engine.step()
            _sync(device)
        profile["prof"] = prof
    _sync(device)
    steady_start, generated = time.perf_counter(), engine.stats.generated_tokens
    while any(not r.finished for r in reqs):
        engine.step()
    _sync(device)
    end = time.perf_counter()
    return dict(total=end - start, steady=end - steady_start, steady_tokens=engine.stats.generated_tokens - generated)


_RUNS = itertools.count()


def _graph_state(engine) -> dict:
    """Whether the engine's decode and mixed (packed) steps replay CUDA graphs (a capture that failed falls back
    to eager steps), with their replay and step counts."""
    out = {}
    for key, g in (("graphs", engine.graphs), ("mixed_graphs", getattr(engine, "mixed_graphs", None))):
        if g is None:
            out[key] = "off"
        else:
            out[key] = "captured" if g.capture else "eager-fallback"
            out[f"{key}_replays"], out[f"{key}_steps"] = g.replays, g.steps
    return out


def _decode_times(model, kind: str, prompts: list[list[int]], new_tokens: int, device: torch.device,
                  cuda_graphs: bool, profile_steps: int = 0) -> tuple[dict, object | None]:
    """Decode timings of cache ``kind`` (the engine warmed up by a first run: kernels compiled, graphs captured). ``e2e_s``: t(new_tokens) - t(1), the prefill and first token cancelling (decodes of early rows
    that overlap later prompts' prefill included); ``steady_s``: the steady decode of the timed run (see ``_run``)."""
    engine = _engine(model, kind, len(prompts[0]), len(prompts), new_tokens, cuda_graphs)
    with warnings.catch_warnings(record=True) as caught:  # a failed graph capture warns: reported, not hidden
        warnings.simplefilter("always")
        times = {}
        for n in (new_tokens, 1, new_tokens):  # the first warms up (kernels compiled, graphs captured)
            times[n] = _run(engine, prompts, n, device)
        profile = {"steps": profile_steps} if profile_steps else None
        if profile is not None:
            _run(engine, prompts, new_tokens, device, profile)
    for w in caught:
        if issubclass(w.category, RuntimeWarning):
            print(f"[{kind}] warning: {w.message}")
    last = times[new_tokens]
    out = dict(e2e_s=times[new_tokens]["total"] - times[1]["total"], steady_s=last["steady"],
               steady_tokens=last["steady_tokens"], **_graph_state(engine))
    del engine
    return out, (profile or {}).get("prof")


def _kernel_table(prof, device: torch.device, rows: int) -> str:
    """The profiler's table of kernels (and ops) by self device time (CPU time without a GPU)."""
    avg = prof.key_averages()
    keys = ("self_device_time_total", "self_cuda_time_total") if device.type == "cuda" else ("self_cpu_time_total",)
    for key in keys:
        try:
            return avg.table(sort_by=key, row_limit=rows)
        except (AttributeError, KeyError, ValueError):
            continue
    return avg.table(row_limit=rows)


def speed(p: dict, device: torch.device, dtype: torch.dtype, profile_steps: int = 0, out: Path | None = None,
          tag: str = "cpu") -> list[dict]:
    cfg = SPEED_MODELS[p["speed_model"]]
    ctx, batch, new = p["context"], p["batch"], p["new_tokens"]
    shape = {k: v for k, v in cfg.items() if k != "vocab_size"}
    model = _model(shape, cfg["vocab_size"], ctx + new + 16, device, dtype).eval()
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, cfg["vocab_size"], (batch, ctx), generator=gen).tolist()
    rows = []
    base = None
    for kind in _kv_dtypes(device):
        t, prof = _decode_times(model, kind, prompts, new, device, cuda_graphs=True, profile_steps=profile_steps)
        tok_s = batch * (new - 1) / t["e2e_s"]
        steady_tok_s = t["steady_tokens"] / t["steady_s"]
        base = base or (tok_s, steady_tok_s)
        rows.append(dict(mode="speed", kv_cache_dtype=kind, model=p["speed_model"], context=ctx, batch=batch,
                         new_tokens=new, decode_s=round(t["e2e_s"], 4), decode_tok_s=round(tok_s, 1),
                         speedup=round(tok_s / base[0], 3), steady_s=round(t["steady_s"], 4),
                         steady_tokens=t["steady_tokens"], steady_tok_s=round(steady_tok_s, 1),
                         steady_speedup=round(steady_tok_s / base[1], 3),
                         **{k: v for k, v in t.items() if "graphs" in k}))
        if prof is not None:
            table = _kernel_table(prof, device, p.get("profile_rows", 30))
            print(f"--- profile: {kind}, {profile_steps} steady decode steps (engine.step calls) ---\n{table}")
            if out is not None:
                path = out / f"kv-quant-{tag}-profile-{kind}.txt"
                _write_atomic(path, f"{kind}: {profile_steps} steady engine steps, batch {batch}, context {ctx}\n"
                                    f"{table}\n")
                print(f"wrote {path}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _time(fn, args: tuple, device: torch.device, reps: int = 20, warm: int = 3) -> tuple[float, float]:
    """``(device, eager)`` median seconds of one ``fn(*args)``. ``eager``: CUDA events around each Python call
    (the launch's host work included: below ~200 us a GPU waits on it); ``device``: the same calls captured in
    a CUDA graph and replayed, the kernels' own time (what a graph-captured decode step pays). On CPU both are
    the wall time of a call."""
    for _ in range(warm):
        fn(*args)
    samples = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*args)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn(*args)
            samples.append(time.perf_counter() - t)
    eager = sorted(samples)[len(samples) // 2]
    if device.type != "cuda":
        return eager, eager
    calls = 10
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(*args)  # torch's rule: a warm call on the capturing stream first
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn(*args)
    graph.replay()
    samples = []
    for _ in range(max(reps // 2, 3)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / calls)
    del graph
    return sorted(samples)[len(samples) // 2], eager


#: launch configs ``--sweep`` tries on the quantised kernel (each at the default split count and at twice it,
#: at the preset's ``sweep_shapes``)
SWEEP_CONFIGS = (
    dict(block_n=64, num_warps=4, num_stages=3, v_trans=0),  # the first H100 run's config
    dict(block_n=64, num_warps=4, num_stages=3, v_trans=1),
    dict(block_n=128, num_warps=4, num_stages=3, v_trans=0),
    dict(block_n=128, num_warps=4, num_stages=3, v_trans=1),  # the default (GPU_CONFIG_QUANT_SPLIT)
    dict(block_n=128, num_warps=8, num_stages=3, v_trans=1),
    dict(block_n=256, num_warps=8, num_stages=2, v_trans=1),
)


@torch.no_grad()
def kernels(p: dict, device: torch.device, dtype: torch.dtype, sweep: bool = False) -> list[dict]:
    """One decode step's attention of one layer of the speed model's shape: ``paged_attention`` over bf16 pools
    against ``paged_attention_quant`` over int8 / fp8 pools, through the registry (what a model step calls).
    ``sweep``: also the quantised Triton kernel at every ``SWEEP_CONFIGS`` launch config and split count."""
    from plyx.kernel import registry
    from plyx.kernel.attention._paged import num_splits_for
    from plyx.kernel.reference.store_kv_quant import quantize_kv

    cfg = SPEED_MODELS[p["speed_model"]]
    H, KV = cfg["n_heads"], cfg["n_kv_heads"]
    D = cfg["d_model"] // H
    bs = 16
    rows = []
    kinds = _kv_dtypes(device)
    storage = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    interp = os.environ.get("TRITON_INTERPRET", "0") == "1"  # the sweep's code path on CPU (tiles ignored there)
    for ctx in p["kernel_contexts"]:
        for batch in p["kernel_batches"]:
            width = -(-ctx // bs)
            gen = torch.Generator(device=device).manual_seed(0)
            k = torch.randn(batch * width, bs, KV, D, device=device, dtype=dtype, generator=gen)
            v = torch.randn(batch * width, bs, KV, D, device=device, dtype=dtype, generator=gen)
            q = torch.randn(batch, 1, H, D, device=device, dtype=dtype, generator=gen)
            tables = torch.arange(batch * width, device=device, dtype=torch.int32).view(batch, width)
            lens = torch.full((batch,), ctx, device=device, dtype=torch.int32)
            base = None
            for kind in kinds:
                if kind == "auto":
                    fn = registry().get("paged_attention", q, k, v, head_dim=D)
                    args: tuple = (q, k, v, tables, lens)
                    pool_bytes = 2 * k.numel() * k.element_size()
                else:
                    qk, sk = quantize_kv(k, storage[kind])
                    qv, sv = quantize_kv(v, storage[kind])
                    fn = registry().get("paged_attention_quant", q, qk, qv, head_dim=D, fp8=int(kind == "fp8_e4m3"))
                    args = (q, qk, qv, sk, sv, tables, lens)
                    pool_bytes = 2 * (qk.numel() * qk.element_size() + sk.numel() * sk.element_size())
                seconds, eager = _time(fn, args, device)
                base = base or seconds
                shape = dict(heads=H, kv_heads=KV, head_dim=D, context=ctx, batch=batch)
                rows.append(dict(mode="kernel", kv_cache_dtype=kind, impl=getattr(fn, "__name__", "?"), **shape,
                                 us=round(seconds * 1e6, 2), eager_us=round(eager * 1e6, 2),
                                 GB_s=round(pool_bytes / seconds / 1e9, 1), speedup=round(base / seconds, 3)))
                if sweep and kind != "auto" and (ctx, batch) in p["sweep_shapes"] and (device.type == "cuda" or interp):
                    from plyx.kernel.attention import paged_attention_quant_triton

                    splits = num_splits_for(batch, KV, width * bs, 64, sms)
                    gpu = device.type == "cuda"  # else the interpreter: two configs, once, to prove the path
                    for conf in SWEEP_CONFIGS if gpu else SWEEP_CONFIGS[:2]:
                        for ns in sorted({splits, 2 * splits} if gpu else {splits}):
                            def run(*a, conf=conf, ns=ns):
                                return paged_attention_quant_triton(*a, num_splits=ns, config=conf)
                            try:
                                sec, _ = _time(run, args, device, reps=10 if gpu else 1, warm=3 if gpu else 0)
                            except Exception as exc:  # a config that does not compile (shared memory): noted
                                print(f"sweep {kind} {conf} splits={ns}: {type(exc).__name__}: {exc}"[:300])
                                continue
                            rows.append(dict(mode="kernel-sweep", kv_cache_dtype=kind, **shape, **conf,
                                             num_splits=ns, us=round(sec * 1e6, 2),
                                             GB_s=round(pool_bytes / sec / 1e9, 1), speedup=round(base / sec, 3)))
                del args
            del k, v
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="gpu" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--mode", choices=["quality", "speed", "kernel", "all"], default="all")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--train-steps", type=int, default=None, help="override the preset's training steps")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="speed mode: torch.profiler over STEPS steady decode steps (engine.step calls, each up to "
                         "decode_steps tokens) per cache dtype; the kernel table is printed and written beside the "
                         "results (kv-quant-<device>-profile-<dtype>.txt)")
    ap.add_argument("--sweep", action="store_true",
                    help="kernel mode: also time the quantised kernel at every SWEEP_CONFIGS launch config")
    ap.add_argument("--kv-dtypes", default=",".join(KV_DTYPES[1:]),
                    help="quantised cache dtypes to run beside the unquantised baseline (comma-separated: int8,fp8_e4m3)")
    args = ap.parse_args()
    unknown = set(args.kv_dtypes.split(",")) - set(KV_DTYPES)
    if unknown:
        ap.error(f"--kv-dtypes: unknown {sorted(unknown)}; use a comma-separated subset of {', '.join(KV_DTYPES[1:])}")
    SELECTED[:] = args.kv_dtypes.split(",")
    p = PRESETS[args.preset]
    device = torch.device(args.device)
    dtype = getattr(torch, p["dtype"])
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"{platform.processor() or platform.machine()} x{os.cpu_count()} threads={torch.get_num_threads()}"
    meta = dict(device=name, date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                torch=torch.__version__, dtype=p["dtype"], preset=args.preset)
    print(f"device: {name}, {meta['date']}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_id = re.search(r"\b[A-Z]{1,2}\d{2,4}\b", name)  # "NVIDIA H100 80GB HBM3" -> h100
    tag = "cpu" if device.type == "cpu" else "cuda-" + (model_id.group(0) if model_id else "gpu").lower()
    rows: list[dict] = []
    if args.mode in ("quality", "all"):
        rows += quality(p, device, dtype, args.train_steps)
    if args.mode in ("kernel", "all"):
        rows += kernels(p, device, dtype, sweep=args.sweep)
    if args.mode in ("speed", "all"):
        rows += speed(p, device, dtype, profile_steps=args.profile, out=out, tag=tag)
    path = out / f"kv-quant-{tag}.jsonl"
    with path.open("a") as f:
        for row in rows:
            f.write(json.dumps({**meta, **row}) + "\n")
    for row in rows:
        print("  ".join(f"{k}={v}" for k, v in row.items()))
    print(f"appended {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
