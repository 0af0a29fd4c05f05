"""``plyx train [CONFIG]`` and ``plyx data prepare|inspect``, contributed through ``plyx_cli_commands``."""

from __future__ import annotations

import argparse
import functools
import json
import shlex
import sys
from importlib import resources
from pathlib import Path
from typing import Any

from plyx.specs import ConfigError, PlyxError, TrainConfig, load_config

__all__ = ["configure_train", "run_train", "configure_data", "run_data", "apply_overrides", "shipped_configs",
           "next_commands"]


def shipped_configs() -> dict[str, Path]:
    """Configs shipped with plyx-train, by name (``shakespeare-char``: nanoGPT's char-level recipe)."""
    root = resources.files("plyx.train").joinpath("configs")
    return {Path(str(f)).stem: Path(str(f)) for f in root.iterdir() if str(f).endswith(".toml")}


# -- plyx train -------------------------------------------------------------------------
def configure_train(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="TrainConfig file (TOML, JSON or YAML) or a shipped config's name "
                        f"({', '.join(sorted(shipped_configs()))}); default: the embedded small-model-on-Tiny-"
                        "Shakespeare run (`--print-config` shows it)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a field, dotted for nested ones: --set steps=200 --set model.d_model=256 "
                             "(values are read as JSON when they parse, else as strings)")
    parser.add_argument("--steps", type=int, help="shortcut for --set steps=N")
    parser.add_argument("--out-dir", help="shortcut for --set out_dir=DIR")
    parser.add_argument("--device", help="shortcut for --set device=DEV (auto, cpu, cuda, cuda:N)")
    parser.add_argument("--resume", nargs="?", const="auto", metavar="CHECKPOINT",
                        help="continue a run: the out_dir's latest checkpoint, or the one given")
    parser.add_argument("--overwrite", action="store_true", help="start fresh even if out_dir has checkpoints")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar: a line every log_every steps (also what a pipe or a file gets)")
    parser.add_argument("--no-tensorboard", action="store_true", help="write metrics.csv only")
    parser.add_argument("--spectral-probe", type=int, default=0, metavar="N",
                        help="every N steps, log each layer's MLP/attention spectral-norm ratio (warn outside 0.5-2)")
    parser.add_argument("--peak-flops", type=float, help="the device's peak FLOP/s, for MFU on CPUs and unknown GPUs")
    parser.add_argument("--print-config", action="store_true", help="print the effective config as JSON and exit")
    parser.add_argument("--name", help="the model card's name (default: the out_dir's name; plyx serve's model id)")
    parser.add_argument("--license", help="the model card's SPDX licence id (default: NOASSERTION)")
    parser.add_argument("--description", help="the model card's description (default: model, data, steps, losses)")
    parser.add_argument("--nproc", type=int, metavar="N", help="train on N processes of this machine through "
                        "torch.distributed.run; the config's [dist] table picks DDP, FSDP or FSDP+TP (needs plyx-dist)")


def set_overrides(doc: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``--set KEY=VALUE`` items written into a config document in place (``a.b=1`` makes tables as needed).

    Values are JSON where they parse (``10``, ``true``, ``{"k": 1}``), else strings. Shared by every plane's
    ``--set`` (plyx-rl's commands too), so they all read an override the same way.

    Returns:
        ``doc``.
    """
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError("--set", "expected KEY=VALUE", value=item, fix="write e.g. --set model.n_layers=6")
        try:
            value: Any = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        node = doc
        parts = key.split(".")
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {} if node.get(part) is None else node[part]
                if not isinstance(node[part], dict):
                    raise ConfigError(f"$.{key}", f"`{part}` is not a table", value=item)
            node = node[part]
        node[parts[-1]] = value
    return doc


def apply_overrides(config: TrainConfig, overrides: list[str]) -> TrainConfig:
    """``["model.d_model=256", "steps=10"]`` applied to ``config`` and validated again."""
    return TrainConfig.from_dict(set_overrides(config.to_dict(), overrides), source="--set")


def _load(args: argparse.Namespace) -> TrainConfig:
    from plyx.train._defaults import default_config

    source = args.config
    if source and not Path(source).exists() and source in shipped_configs():
        source = str(shipped_configs()[source])
    config = load_config(TrainConfig, source) if source else default_config()
    overrides = list(args.overrides)
    for flag, key in (("steps", "steps"), ("out_dir", "out_dir"), ("device", "device")):
        value = getattr(args, flag)
        if value is not None:
            overrides.append(f"{key}={json.dumps(value)}")
    steps = args.steps
    if steps is not None and not any(o.startswith("schedule.warmup_steps=") for o in args.overrides):
        warmup = config.schedule.warmup_steps
        if steps > 1 and warmup >= steps:  # the --steps shortcut keeps the warmup a tenth of a short run
            overrides.append(f"schedule.warmup_steps={steps // 10}")
            print(f"note: schedule.warmup_steps {warmup} -> {steps // 10} for a run of {steps} steps", file=sys.stderr)
    return apply_overrides(config, overrides) if overrides else config


def run_train(args: argparse.Namespace) -> int:
    from plyx.train._launch import quiet_other_ranks, spawn
    from plyx.train._trainer import Trainer, TrainOptions

    if getattr(args, "nproc", None) and not args.print_config:
        return spawn(args)  # this process launches the ranks; each runs this command without --nproc
    quiet_other_ranks()
    try:
        config = _load(args)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(json.dumps(config.to_dict(), indent=2))
        return 0
    if config.draft is not None:
        return _run_draft(args, config)
    if args.resume == "auto":
        from plyx.train._checkpoint import CheckpointManager

        if not CheckpointManager(Path(config.out_dir) / "checkpoints").steps():
            print(f"error: --resume: {config.out_dir} holds no checkpoint to resume (no "
                  f"{Path(config.out_dir) / 'checkpoints'}/step-*); drop --resume to start a fresh run there, or "
                  f"pass --resume CHECKPOINT_OR_RUN_DIR", file=sys.stderr)
            return 2
    say = functools.partial(print, flush=True)  # a pipe sees each line as it is printed
    options = TrainOptions(
        resume=args.resume,
        overwrite=args.overwrite,
        progress=not args.no_progress,
        tensorboard=not args.no_tensorboard,
        spectral_probe_every=args.spectral_probe,
        peak_flops=args.peak_flops,
        print_fn=say,
        name=args.name,
        license=args.license,
        description=args.description,
    )
    try:
        trainer = Trainer(config, options=options)
    except (PlyxError, ValueError, FileNotFoundError, LookupError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    m = trainer.module
    say(
        f"plyx train: {m.num_params():,} parameters on {trainer.device}, data {trainer.data_dir} "
        f"({trainer.shards.tokens('train'):,} train tokens), {config.steps} steps of "
        f"{config.batch_size}x{config.data.seq_len} tokens -> {trainer.out_dir}"
    )
    if trainer.step:
        say(f"resuming at step {trainer.step} from {trainer.last_checkpoint}")
    try:
        result = trainer.fit()
    except PlyxError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    metrics = result.metrics
    summary = f"step {result.step}: loss {metrics.get('loss', float('nan')):.4f}"
    if "val_loss" in metrics:
        summary += f", val_loss {metrics['val_loss']:.4f} (ppl {metrics['val_ppl']:.2f})"
    print(summary)
    print(f"checkpoint: {result.checkpoint}")
    print(f"metrics: {result.out_dir / 'metrics.csv'}")
    if result.stopped:
        print(f"stopped by {result.stopped}; continue with `plyx train --resume` (same config)")
        return 130 if result.stopped == "SIGINT" else 143
    if result.sample:
        print("sample:\n" + result.sample)
    if result.checkpoint is not None:
        print("next:\n" + next_commands(Path(result.checkpoint), model_id=args.name or config.card.name or None))
    return 0


def _run_draft(args: argparse.Namespace, config: TrainConfig) -> int:
    """``plyx train CONFIG`` with a ``[draft]`` table: heads trained on the frozen ``draft.base``."""
    from plyx.train._draft import DraftTrainer

    if args.resume:
        print("error: --resume: a draft-heads run is short and restarts from the base; drop --resume",
              file=sys.stderr)
        return 2
    say = functools.partial(print, flush=True)
    try:
        trainer = DraftTrainer(config, progress=not args.no_progress, tensorboard=not args.no_tensorboard,
                               print_fn=say)
    except (PlyxError, ValueError, FileNotFoundError, LookupError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    d = config.draft
    assert d is not None
    trained = sum(p.numel() for p in trainer.heads.parameters())
    say(f"plyx train: {d.kind} draft heads ({trained:,} parameters) on the frozen base {d.base} "
        f"({trainer.base.num_params():,} parameters) on {trainer.device}, data {trainer.data_dir}, {config.steps} "
        f"steps of {config.batch_size}x{config.data.seq_len} tokens -> {trainer.out_dir}")
    try:
        result = trainer.fit()
    except (PlyxError, FloatingPointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    accs = {k: v for k, v in result.metrics.items() if k.startswith(("acc/", "val_acc/"))}
    print(f"step {result.step}: loss {result.metrics.get('loss', float('nan')):.4f}; top-1 accuracy "
          + ", ".join(f"{k} {v:.3f}" for k, v in accs.items()))
    print(f"draft heads: {result.heads}")
    if result.stopped:
        print(f"stopped by {result.stopped}; the heads so far are saved")
        return 130
    print("next (Python, plyx-serve):\n"
          f"  generate(load_checkpoint({str(d.base)!r}), prompts, params, draft_model={str(result.heads)!r})\n"
          f"  python packages/serve/bench/bench_draft_heads.py --base ... --heads ...   # acceptance, speedup")
    return 0


def next_commands(checkpoint: Path, *, model_id: str | None = None) -> str:
    """The commands a user runs after training, with this run's real paths (indented, one per line).

    Args:
        checkpoint: the checkpoint just written (``<out_dir>/checkpoints/step-N``).
        model_id: the model card's name (``--name`` or the config's ``[card] name``); default: the run's name.

    Returns:
        the lines.
    """
    run = checkpoint.parent.parent
    latest = checkpoint.parent / "latest"
    served = latest if latest.is_symlink() else checkpoint
    try:  # relative to the cwd when inside it: shorter to copy
        served, checkpoint = served.relative_to(Path.cwd()), checkpoint.relative_to(Path.cwd())
    except ValueError:
        pass
    q = shlex.quote
    return "\n".join([
        f"  plyx model inspect {q(str(checkpoint))}",
        f"  plyx serve {q(str(served))} --port 8000        # OpenAI API; model id {q(model_id or run.name)}",
        f"  plyx export {q(str(served))} --format onnx --out {q(str(Path('exports') / run.name))}",
        f"  plyx governance verify {q(str(Path('exports') / run.name))}",
    ])


# -- plyx data ----------------------------------------------------------------------------
def configure_data(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    p = sub.add_parser("prepare", help="tokenize a corpus into memory-mapped shards with a manifest")
    p.add_argument("corpus", nargs="?", help="a text file, a .jsonl file (`text` field) or a directory; "
                   "default: the bundled Tiny Shakespeare")
    p.add_argument("--out", required=True, help="the prepared data directory")
    p.add_argument("--tokenizer", help="an existing tokenizer.json, or `char` for one id per character (nanoGPT's "
                   "shakespeare_char); default: train a byte-level BPE")
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary to train (default 4096)")
    p.add_argument("--val-fraction", type=float, default=0.1, help="held-out fraction (default 0.1)")
    p.add_argument("--separator", help="split text files into documents on this string (e.g. '\\n\\n'; "
                   "escapes are decoded)")
    p.add_argument("--no-hooks", action="store_true", help="skip plyx_document_filters plugins")
    p.add_argument("--encoding", default="utf-8", help="the corpus files' text encoding (default utf-8; e.g. latin-1)")
    p.add_argument("--errors", default="strict", choices=["strict", "replace", "ignore"],
                   help="undecodable bytes: stop naming file and offset (strict), U+FFFD (replace), drop (ignore)")
    p = sub.add_parser("inspect", help="check a prepared directory (sizes and sha256) and summarise it")
    p.add_argument("path", help="the prepared data directory")


def run_data(args: argparse.Namespace) -> int:
    from plyx.train._prepare import BUNDLED_SEPARATOR, bundled_corpus, prepare_corpus
    from plyx.train._shards import ShardError, ShardSet

    if args.data_command == "inspect":
        try:
            shards = ShardSet.open(args.path, verify=True)
        except ShardError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        m = shards.manifest
        print(f"{shards.root}: {m['dtype']} ids, vocab {m['vocab_size']}, eos {m['eos_id']}, "
              f"tokenizer {m.get('tokenizer') or '-'}; all shards verified")
        for split, entries in shards.shards.items():
            print(f"  {split}: {sum(i.tokens for i, _ in entries):,} tokens in {len(entries)} shard(s)")
        return 0
    separator = args.separator.encode().decode("unicode_escape") if args.separator else None
    corpus = args.corpus
    if corpus is None:
        corpus, separator = bundled_corpus(), separator or BUNDLED_SEPARATOR
    try:
        report = prepare_corpus(corpus, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                                val_fraction=args.val_fraction, separator=separator, use_hooks=not args.no_hooks,
                                encoding=args.encoding, errors=args.errors)
    except (ValueError, FileNotFoundError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    tokens = ", ".join(f"{k} {v:,}" for k, v in report.tokens.items())
    print(f"prepared {report.documents:,} documents ({report.dropped} dropped, {report.redacted} redacted by "
          f"filters) -> {report.out_dir}: vocab {report.vocab_size}, tokens: {tokens}")
    return 0
