"""``plyx rl sft|dpo|orpo|simpo|kto|grpo|distill|rm CONFIG`` and ``plyx rl judge``, contributed through
``plyx_cli_commands``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from plyx.specs import ConfigError, PlyxError, load_config
from plyx.train import set_overrides

__all__ = ["configure_rl", "run_rl"]

_METHODS = ("sft", "dpo", "orpo", "simpo", "kto", "grpo")
#: commands run by other modules: name -> (help, config class path, run function path)
_EXTRA = {
    "distill": ("knowledge distillation from a teacher (forward_kl | reverse_kl | jsd | topk; off- or on-policy)",
                "plyx.rl._distill_run:DistillConfig", "plyx.rl._distill_run:distill"),
    "rm": ("reward model: a scalar head trained on preference pairs (Bradley-Terry loss, margin option)",
           "plyx.rl._reward_model:RewardModelConfig", "plyx.rl._reward_model:train_reward_model"),
}


def _resolve(path: str) -> Any:
    import importlib

    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def configure_rl(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="rl_command", metavar="METHOD", required=True)
    helps = {"sft": "supervised fine-tuning (conversations, prompt/completion, text)",
             "dpo": "direct preference optimisation (loss_type sigmoid | ipo | hinge | robust; reference_free)",
             "orpo": "odds-ratio preference optimisation (no reference model)",
             "simpo": "simple preference optimisation (length-normalised, no reference model)",
             "kto": "Kahneman-Tversky optimisation on unpaired desirable/undesirable examples",
             "grpo": "online GRPO with verifiable rewards (loss_type grpo | dr_grpo | dapo), sampling with "
                     "plyx-serve's engine"}
    for name in _METHODS:
        p = sub.add_parser(name, help=helps[name])
        schema = {"sft": "SFTConfig", "grpo": "GRPOConfig"}.get(name, "PreferenceConfig")
        p.add_argument("config", help=f"{schema} file (TOML, JSON or YAML)")
        p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a field, dotted for nested ones: --set steps=200 --set adapter.r=16")
        p.add_argument("--out-dir", help="shortcut for --set out_dir=DIR")
        p.add_argument("--strict", action="store_true", help="raise on the first record that would be skipped")
        p.add_argument("--overwrite", action="store_true", help="replace the results of a previous run in out_dir")
        p.add_argument("--no-progress", action="store_true", help="no progress bar (log lines instead)")
        p.add_argument("--print-config", action="store_true", help="print the effective config as JSON and exit")
        if name == "grpo":
            p.add_argument("--resume", action="store_true",
                           help="continue from out_dir/state (policy, optimizer, RNG, sampler, data position)")
    for name, (text, cls_path, _) in _EXTRA.items():
        p = sub.add_parser(name, help=text)
        p.add_argument("config", help=f"{cls_path.rpartition(':')[2]} file (TOML, JSON or YAML)")
        p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a field, dotted for nested ones: --set steps=200")
        p.add_argument("--out-dir", help="shortcut for --set out_dir=DIR")
        p.add_argument("--strict", action="store_true", help="raise on the first record that would be skipped")
        p.add_argument("--overwrite", action="store_true", help="replace the results of a previous run in out_dir")
        p.add_argument("--no-progress", action="store_true", help="no progress bar (log lines instead)")
        p.add_argument("--print-config", action="store_true", help="print the effective config as JSON and exit")
    from plyx.rl._judge import configure_judge

    configure_judge(sub.add_parser("judge", help="rank models from pairwise judge verdicts (Bradley-Terry, "
                                   "bootstrap intervals, position-bias check)"))


def _load(args: argparse.Namespace) -> Any:
    from plyx.rl._config import PreferenceConfig, SFTConfig
    from plyx.rl._grpo_config import GRPOConfig

    if args.rl_command in _EXTRA:
        cls = _resolve(_EXTRA[args.rl_command][1])
    else:
        cls = {"sft": SFTConfig, "grpo": GRPOConfig}.get(args.rl_command, PreferenceConfig)
    config = load_config(cls, args.config)
    doc = config.to_dict()
    overrides = list(args.overrides)
    if args.out_dir:
        overrides.append(f"out_dir={json.dumps(args.out_dir)}")
    if args.strict:
        overrides.append("strict=true")
    if cls is PreferenceConfig:
        if doc.get("method") not in (None, args.rl_command) and not any(o.startswith("method=") for o in overrides):
            print(f"note: method {doc['method']!r} of {args.config} -> {args.rl_command!r} (the command)",
                  file=sys.stderr)
        overrides.append(f"method={json.dumps(args.rl_command)}")
    return cls.from_dict(set_overrides(doc, overrides), source="--set")


def run_rl(args: argparse.Namespace) -> int:
    from plyx.rl._chat import ChatTemplateError
    from plyx.rl._data import DataError
    from plyx.rl._run import preference, sft

    if args.rl_command == "judge":
        from plyx.rl._judge import run_judge

        return run_judge(args)
    try:
        config = _load(args)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(json.dumps(config.to_dict(), indent=2))
        return 0
    try:
        if args.rl_command == "grpo":
            from plyx.rl._grpo import grpo

            result = grpo(config, overwrite=args.overwrite, resume=args.resume, progress=not args.no_progress)
        else:
            if args.rl_command in _EXTRA:
                run = _resolve(_EXTRA[args.rl_command][2])
            else:
                run = sft if args.rl_command == "sft" else preference
            result = run(config, overwrite=args.overwrite, progress=not args.no_progress)
    except (DataError, ChatTemplateError, FileExistsError, FileNotFoundError, LookupError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (PlyxError, FloatingPointError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    last = result.metrics
    shown = {k: v for k, v in last.items() if k in ("loss", "rewards/accuracies", "rewards/margins", "kl", "reward",
                                                    "accuracy", "eval/accuracy", "eval/divergence_before",
                                                    "eval/divergence_after")}
    print(f"step {result.step}: " + ", ".join(f"{k} {v:.4f}" for k, v in shown.items()))
    if result.model_dir:
        print(f"model: {result.model_dir}")
    if result.adapter_dir:
        print(f"adapter: {result.adapter_dir}")
    print(f"metrics: {result.out_dir / 'metrics.jsonl'}")
    if result.stopped:
        print(f"stopped by {result.stopped}; the model trained so far was saved")
        return 130 if result.stopped == "SIGINT" else 143
    return 0
