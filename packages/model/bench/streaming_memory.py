"""Peak memory of the layer-streaming forward vs the bulk forward, for 4, 8, 16 and 32 layers.

Each measurement runs in a fresh process (peak RSS is per process and never
goes down). For each depth a checkpoint is written, then:

- bulk: ``load_checkpoint`` + one forward;
- streaming: ``LayerStreamer(path)`` + one forward (weights stay on disk).

On a CUDA machine it also measures ``torch.cuda.max_memory_allocated`` for
streaming from CPU memory to the GPU vs the bulk model on the GPU.

Usage::

    python packages/model/bench/streaming_memory.py [--layers 4 8 16 32] [--d-model 1024]

Results are appended to ``packages/model/bench/results/streaming_memory.jsonl``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "streaming_memory.jsonl"


def config(layers: int, d_model: int):
    from plyx.specs import ModelConfig

    return ModelConfig(arch="llama", vocab_size=8192, d_model=d_model, n_layers=layers, n_heads=d_model // 64,
                       n_kv_heads=d_model // 128, d_ff=int(d_model * 2.75), max_seq_len=1024)


def peak_rss_mib() -> float:
    """This process's peak resident set size.

    VmHWM, not ``getrusage().ru_maxrss``: Linux carries ru_maxrss across
    fork + exec, so a child would report the parent's peak (which holds a model).
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # macOS: bytes there, close enough to flag


def child(mode: str, path: str, device: str, seq: int) -> None:
    """Runs in the measured process: one forward, then prints its peak memory as JSON."""
    import torch
    from plyx.model import LayerStreamer, load_checkpoint

    ids = torch.randint(0, 8192, (1, seq))
    with torch.no_grad():
        if mode == "bulk":
            model = load_checkpoint(path, device=device)
            logits = model(ids)
        else:
            streamer = LayerStreamer(path, device=device)
            logits = streamer(ids)
    assert torch.isfinite(logits).all()
    out = {"peak_rss_mib": peak_rss_mib()}
    if device.startswith("cuda"):
        out["peak_cuda_mib"] = torch.cuda.max_memory_allocated() / 2**20
    print(json.dumps(out))


def measure(mode: str, path: Path, device: str, seq: int) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", mode, str(path), device, str(seq)],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, path, device, seq = args.child
        child(mode, path, device, int(seq))
        return
    import torch
    from plyx.model import TransformerLM, save_checkpoint

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    rows = []
    print(f"{'device':<6} {'layers':>6} {'weights MiB':>11} {'bulk peak MiB':>14} {'stream peak MiB':>16}")
    for layers in args.layers:
        cfg = config(layers, args.d_model)
        with tempfile.TemporaryDirectory() as tmp:
            torch.manual_seed(0)
            model = TransformerLM(cfg)
            weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
            path = save_checkpoint(model, Path(tmp) / "ckpt", max_shard_bytes=256 << 20)
            del model
            for device in devices:
                bulk = measure("bulk", path, device, args.seq)
                stream = measure("stream", path, device, args.seq)
                key = "peak_cuda_mib" if device == "cuda" else "peak_rss_mib"
                row = {"device": device, "layers": layers, "weights_mib": round(weights, 1),
                       "bulk_peak_mib": round(bulk[key], 1), "stream_peak_mib": round(stream[key], 1),
                       "bulk_rss_mib": round(bulk["peak_rss_mib"], 1), "stream_rss_mib": round(stream["peak_rss_mib"], 1)}
                rows.append(row)
                print(f"{device:<6} {layers:>6} {weights:>11.0f} {row['bulk_peak_mib']:>14.0f} {row['stream_peak_mib']:>16.0f}")
    for device in devices:
        mine = [r for r in rows if r["device"] == device]
        growth_stream = mine[-1]["stream_peak_mib"] - mine[0]["stream_peak_mib"]
        growth_bulk = mine[-1]["bulk_peak_mib"] - mine[0]["bulk_peak_mib"]
        print(f"{device}: from {mine[0]['layers']} to {mine[-1]['layers']} layers, bulk peak grows {growth_bulk:.0f} MiB, "
              f"streaming peak grows {growth_stream:.0f} MiB")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    meta = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "machine": platform.node(),
            "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "d_model": args.d_model, "seq": args.seq}
    with RESULTS.open("a") as f:
        for row in rows:
            f.write(json.dumps({**meta, **row}) + "\n")


if __name__ == "__main__":
    main()
