"""The prefill worker: its own process, its own engine, the producer end of a KV connector.

Started by the front end (``plyx serve PATH --disaggregate``) as ``python -m plyx.serve.disagg PATH --address
HOST:PORT ...``; it loads the checkpoint on its device, joins the connector and answers each prompt with the KV
blocks of its full blocks (computed by its engine: chunked prefill and a prefix cache of its own). It exits
when the front end closes the connector or goes away.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

__all__ = ["build_prefill_engine", "main", "worker_argv"]

log = logging.getLogger("plyx.serve.disagg")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m plyx.serve.disagg", description="plyx-serve prefill worker")
    p.add_argument("path", help="the checkpoint the front end serves")
    p.add_argument("--address", required=True, help="host:port of the front end's KV connector store")
    p.add_argument("--connector", default="torch_distributed", help="KV connector plugin name")
    p.add_argument("--backend", default="auto", help="auto | gloo | nccl (torch_distributed)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=0)
    p.add_argument("--max-batch-tokens", type=int, default=2048)
    p.add_argument("--memory-fraction", type=float, default=0.3)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    return p


def worker_argv(path: str, address: str, *, connector: str, backend: str, device: str, dtype: str,
                block_size: int, num_blocks: int, max_model_len: int, max_batch_tokens: int, memory_fraction: float,
                timeout: float, threads: int = 0) -> list[str]:
    """The command line that starts a prefill worker (``sys.executable -m plyx.serve.disagg ...``)."""
    return [sys.executable, "-m", "plyx.serve.disagg", str(path), "--address", address, "--connector", connector,
            "--backend", backend, "--device", device, "--dtype", dtype, "--block-size", str(block_size),
            "--num-blocks", str(num_blocks), "--max-model-len", str(max_model_len),
            "--max-batch-tokens", str(max_batch_tokens), "--memory-fraction", str(memory_fraction),
            "--timeout", str(timeout), "--threads", str(threads)]


def build_prefill_engine(model: Any, *, block_size: int, num_blocks: int, max_model_len: int,
                         max_batch_tokens: int) -> Any:
    """The worker's engine: prefix caching on (its blocks leave through it), a few sequences at a time."""
    from plyx.serve.engine import Engine, EngineConfig

    return Engine(model, config=EngineConfig(
        max_batch_size=4, max_batch_tokens=max(max_batch_tokens, 4), block_size=block_size, num_blocks=num_blocks,
        max_model_len=max_model_len, prefix_caching=True, cuda_graphs=False, look_ahead=False,
        guardrails=False))  # the decode side's server guarded the request once already


def prefill(engine: Any, prompt_ids: list[int]) -> Any:
    """Compute ``prompt_ids`` (one greedy token, discarded: the decode side samples its own) and export its
    full blocks."""
    from plyx.serve._params import SamplingParams
    from plyx.serve.engine._kv_transfer import export_prefix

    engine.check_prompt(prompt_ids)
    engine.generate([prompt_ids], SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True))
    return export_prefix(engine, prompt_ids)


def main(argv: list[str] | None = None) -> int:
    import torch
    from plyx.serve.disagg._connector import get_kv_connector
    from plyx.serve.engine._kv_transfer import kv_geometry
    from plyx.serve.server._cli import _num_blocks
    from plyx.serve.server._loading import load_model
    from plyx.serve.server._paths import PathError
    from plyx.specs.errors import PlyxError

    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="prefill-worker %(levelname)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:  # what cannot be loaded is one line (the front end quotes this log's tail), not a traceback
        model = load_model(args.path, device=str(device), dtype=args.dtype)
        sizing = argparse.Namespace(num_blocks=args.num_blocks, block_size=args.block_size,
                                    memory_fraction=args.memory_fraction)
        engine = build_prefill_engine(model, block_size=args.block_size,
                                      num_blocks=_num_blocks(sizing, model, device),
                                      max_model_len=args.max_model_len, max_batch_tokens=args.max_batch_tokens)
        connector = get_kv_connector(args.connector)(role="producer", address=args.address, timeout=args.timeout,
                                                     device=device, backend=args.backend)
    except (PlyxError, PathError, ValueError, OSError) as exc:
        print(f"prefill worker: error: {exc}", file=sys.stderr)
        return 1
    connector.connect(kv_geometry(engine), engine.cache.kv_blocks(0)[0].dtype)
    log.info("serving prefills on %s (%d KV blocks)", device, engine.cache.layout.num_blocks)
    try:
        with torch.inference_mode():
            connector.serve(lambda prompt: prefill(engine, prompt))
    except RuntimeError as exc:  # the front end went away: nothing left to serve
        log.info("the front end closed the connection (%s); exiting", str(exc).splitlines()[0][:200])
    finally:
        connector.close()
    return 0
