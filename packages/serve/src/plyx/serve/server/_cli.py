"""``plyx serve PATH --host H --port P [--api-key K]``: the OpenAI-compatible server on uvicorn.

Shutdown (SIGINT / SIGTERM): uvicorn stops accepting connections and waits up to
``--drain-timeout`` seconds for in-flight responses; then the engine ends whatever is
left (streams get a final chunk) and its thread stops.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from plyx.specs.components import CliCommand

__all__ = ["SERVE_COMMAND", "build_server", "serve_config_from_args"]


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", metavar="PATH", help="plyx checkpoint or Hugging Face model directory (with tokenizer.json)")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 picks a free one)")
    p.add_argument("--api-key", default=os.environ.get("PLYX_API_KEY", ""),
                   help="bearer token required on /v1/* (default: $PLYX_API_KEY; empty disables auth)")
    p.add_argument("--served-model-name", "--served-name", dest="served_name", default="",
                   help="the model id of /v1/models and requests (default: the checkpoint card's name, which "
                        "`plyx train` sets to the run's name; else the directory name); the directory's own name "
                        "(e.g. step-001000) is also accepted")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    p.add_argument("--num-blocks", type=int, default=0, help="KV-cache blocks (0: sized from --memory-fraction)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bf16", "int8", "fp8_e4m3"],
                   help="KV-cache storage: int8 (any device) / fp8_e4m3 (Hopper) halve its memory per token")
    p.add_argument("--memory-fraction", type=float, default=0.5, help="share of free GPU memory for the KV cache")
    p.add_argument("--max-batch-size", type=int, default=64, help="most sequences per step")
    p.add_argument("--max-batch-tokens", type=int, default=2048, help="token budget per step (prefill chunking)")
    p.add_argument("--max-model-len", type=int, default=0, help="prompt + completion limit (0: the model's)")
    p.add_argument("--mixed-chunk", type=int, default=-1,
                   help="prefill chunk (<= 16) run inside the decode forward; -1: 16 on CUDA, 0 (off) on CPU")
    p.add_argument("--no-prefix-caching", action="store_true", help="do not reuse KV blocks of shared prefixes")
    p.add_argument("--stream-interval", type=int, default=0, metavar="N",
                   help="tokens per streamed event of a multi-step decode block (0, the default: a block's tokens "
                        "in one event; 1: every token its own SSE chunk)")
    p.add_argument("--max-queue", type=int, default=256, help="waiting requests before HTTP 429")
    p.add_argument("--max-request-bytes", type=int, default=1_048_576, help="largest request body (HTTP 413)")
    p.add_argument("--max-concurrent", type=int, default=512, help="most requests in flight (HTTP 429)")
    p.add_argument("--chat-template", default=None,
                   help="chatml | llama3 | plain | a .jinja file (default: the tokenizer config's template)")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get on shutdown")
    p.add_argument("--guardrail-policy", default="", help="plyx-safety policy (needs plyx-safety)")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                   help="a PEFT LoRA adapter directory served as model NAME (repeat for several; requests mix them "
                        "per row in one batch)")
    p.add_argument("--tool-call-parser", default="hermes",
                   help="parser of tool_choice=auto replies: hermes | llama3_json | mistral | a plugin's "
                        "(empty: none)")
    g = p.add_argument_group("speculative decoding with Medusa draft heads (greedy requests)")
    g.add_argument("--draft-heads", default="", metavar="PATH",
                   help="Medusa heads trained on this model (plyx train with a [draft] table): plain-greedy requests "
                   "feed their drafts in each step, verified by the model (same output, fewer steps)")
    g.add_argument("--speculative-k", type=int, default=0, metavar="K",
                   help="draft tokens per request and step (0: one per head)")
    g.add_argument("--spec-tree", type=int, default=0, metavar="TOPK",
                   help="tree verification: each head's top TOPK candidates form a token tree checked in one forward "
                   "(0: a chain of each head's best)")
    g = p.add_argument_group("disaggregated prefill/decode (vLLM's P/D disaggregation)")
    g.add_argument("--disaggregate", action="store_true",
                   help="prefill prompts in a worker process (its own GPU when there are two) and hand their KV "
                        "blocks to this server's decode engine through a KV connector")
    g.add_argument("--prefill-device", default="auto",
                   help="the prefill worker's device (auto: the second GPU if any, else --device's)")
    g.add_argument("--kv-connector", default="torch_distributed",
                   help="KV connector plugin (plyx_kv_connectors); built in: torch_distributed")
    g.add_argument("--kv-backend", default="auto", choices=["auto", "gloo", "nccl"],
                   help="torch_distributed's transport (auto: NCCL between two GPUs, gloo otherwise)")
    g.add_argument("--kv-timeout", type=float, default=120.0,
                   help="seconds a prefill may take before the worker counts as hung (the server then answers 503)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def serve_config_from_args(args: argparse.Namespace) -> Any:
    """A validated ``plyx.specs.ServeConfig`` of the command line (errors name the option and the fix)."""
    from plyx.serve.server._paths import served_names
    from plyx.specs.config.serve import ServeConfig

    return ServeConfig(
        model=str(args.path), served_name=served_names(args.path, args.served_name)[0], host=args.host,
        port=args.port, api_key=args.api_key, device=args.device, dtype=args.dtype, block_size=args.block_size,
        num_blocks=args.num_blocks, memory_fraction=args.memory_fraction, max_batch_size=args.max_batch_size,
        max_batch_tokens=args.max_batch_tokens, max_model_len=args.max_model_len,
        prefix_caching=not args.no_prefix_caching, max_queue=args.max_queue,
        max_request_bytes=args.max_request_bytes, guardrail_policy=args.guardrail_policy,
    )


def _num_blocks(cfg: Any, model: Any, device: Any, kv_cache_dtype: str = "auto") -> int:
    """0 (the engine's default: max_batch_size full sequences) on CPU; a share of free memory on a GPU."""
    import torch

    if cfg.num_blocks or device.type != "cuda":
        return cfg.num_blocks
    free, _ = torch.cuda.mem_get_info(device)
    c = model.config
    # per token, head and side: Dh values (1 byte quantised, plus a float32 scale) or Dh of the cache dtype
    row = {"int8": c.dim_per_head + 4, "fp8_e4m3": c.dim_per_head + 4, "bf16": 2 * c.dim_per_head}.get(
        kv_cache_dtype, c.dim_per_head * next(model.parameters()).element_size())
    bytes_per_block = 2 * c.n_layers * cfg.block_size * c.kv_heads * row
    return max(1, int(free * cfg.memory_fraction) // bytes_per_block)


def lora_specs(values: list[str]) -> dict[str, str]:
    """``--lora NAME=PATH`` values as ``{name: path}``; a malformed or repeated one is a ConfigError."""
    from plyx.specs.errors import ConfigError

    out: dict[str, str] = {}
    for v in values:
        name, sep, path = v.partition("=")
        if not sep or not name or not path:
            raise ConfigError("--lora", "expected NAME=PATH", value=v, fix="e.g. --lora sql=adapters/sql")
        if name in out:
            raise ConfigError("--lora", f"the adapter name {name!r} is given twice", value=v,
                              fix="give each adapter its own name")
        out[name] = path
    return out


def build_server(cfg: Any, *, chat_template: str | None = None, max_concurrent: int = 512,
                 drain_timeout: float = 30.0, mixed_chunk: int = -1, lora: dict[str, str] | None = None,
                 tool_parser: str = "hermes", kv_cache_dtype: str = "auto",
                 disaggregate: dict[str, Any] | None = None, draft_heads: str = "", speculative_k: int = 0,
                 spec_tree: int = 0, stream_interval: int = 0) -> Any:
    """The FastAPI app of a ``ServeConfig`` (model loaded, engine built; its thread starts with the app).

    ``lora`` maps served names to PEFT adapter directories (``plyx.serve.MultiLora``); a name is then a model
    requests may name. ``tool_parser`` parses ``tool_choice=auto`` replies. ``disaggregate`` (keyword
    arguments of ``plyx.serve.disagg.start_prefill_worker``, ``{}`` for its defaults) starts a prefill worker
    and serves through a ``DisaggAsyncEngine``: this process decodes, the worker prefills. ``draft_heads``
    (a Medusa heads directory), ``speculative_k`` and ``spec_tree`` are ``EngineConfig``'s speculation fields."""
    import torch
    from plyx.serve.engine import Engine, EngineConfig
    from plyx.serve.server._app import ServerSettings, create_app
    from plyx.serve.server._loading import eos_ids, load_model, load_tokenizer
    from plyx.serve.server._paths import served_names

    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(cfg.model, device=device, dtype=cfg.dtype)
    multi = None
    if lora:
        from plyx.serve._lora import MultiLora

        multi = MultiLora.load(model, lora)  # a startup error names the adapter that does not fit
    tokenizer = load_tokenizer(cfg.model)
    engine = Engine(
        model,
        tokenizer=tokenizer,
        eos_token_id=eos_ids(cfg.model, tokenizer),
        lora=multi,
        config=EngineConfig(
            max_batch_size=cfg.max_batch_size, max_batch_tokens=cfg.max_batch_tokens, block_size=cfg.block_size,
            num_blocks=_num_blocks(cfg, model, torch.device(device), kv_cache_dtype), max_model_len=cfg.max_model_len,
            kv_cache_dtype=kv_cache_dtype, draft_heads=draft_heads, speculative_k=speculative_k, spec_tree=spec_tree,
            prefix_caching=cfg.prefix_caching, max_queue=cfg.max_queue, stream_interval=stream_interval,
            mixed_chunk=(16 if torch.device(device).type == "cuda" else 0) if mixed_chunk < 0 else mixed_chunk,
        ),
    )
    model_name, aliases = served_names(cfg.model, cfg.served_name)
    settings = ServerSettings(model_name=model_name, model_aliases=aliases, api_key=cfg.api_key,
                              max_request_bytes=cfg.max_request_bytes, max_concurrent=max_concurrent,
                              drain_timeout=drain_timeout, guardrail_policy=cfg.guardrail_policy,
                              tool_parser=tool_parser)
    aengine = None
    if disaggregate is not None:
        from plyx.serve.disagg import DisaggAsyncEngine, start_prefill_worker

        worker = start_prefill_worker(cfg.model, engine, dtype=cfg.dtype, num_blocks=cfg.num_blocks,
                                      **disaggregate)
        aengine = DisaggAsyncEngine(engine, worker)
    return create_app(engine, settings=settings, chat_template=chat_template, model_dir=cfg.model, aengine=aengine)


def _disagg_options(args: argparse.Namespace) -> dict[str, Any] | None:
    """``start_prefill_worker``'s options of ``--disaggregate`` and its flags (None without it)."""
    if not args.disaggregate:
        return None
    return {"device": args.prefill_device, "connector": args.kv_connector, "backend": args.kv_backend,
            "timeout": args.kv_timeout}


def _run(args: argparse.Namespace) -> int:
    import sys

    from plyx.serve.disagg import KVTransferError, WorkerUnavailableError
    from plyx.serve.server._paths import PathError, check_model_path
    from plyx.specs.errors import PlyxError

    # what cannot be served is one line naming the fix, like `plyx model inspect`, not a traceback
    try:
        check_model_path(args.path)
        cfg = serve_config_from_args(args)
        app = build_server(cfg, chat_template=args.chat_template, max_concurrent=args.max_concurrent,
                           drain_timeout=args.drain_timeout, mixed_chunk=args.mixed_chunk,
                           lora=lora_specs(args.lora), tool_parser=args.tool_call_parser,
                           kv_cache_dtype=args.kv_cache_dtype, disaggregate=_disagg_options(args),
                           draft_heads=args.draft_heads, speculative_k=args.speculative_k, spec_tree=args.spec_tree,
                           stream_interval=args.stream_interval)
    except (PathError, PlyxError, ValueError, WorkerUnavailableError, KVTransferError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    worker = getattr(app.state.plyx.aengine, "worker", None)
    if worker is not None:  # where the other process of this server is, and where its output goes
        device = worker.argv[worker.argv.index("--device") + 1]
        print(f"plyx serve: disaggregated; the {worker.name} prefills on {device} (its log: {worker.log_path})",
              file=sys.stderr)
    import uvicorn

    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=args.log_level,
                            timeout_graceful_shutdown=int(args.drain_timeout) or None)
    uvicorn.Server(config).run()
    return 0


SERVE_COMMAND = CliCommand(
    name="serve",
    help="serve a model over the OpenAI HTTP API (completions, chat, streaming, metrics)",
    configure=_configure,
    run=_run,
)
