"""``plyx dist consolidate CKPT OUT``: a sharded (DCP) checkpoint as one plain plyx checkpoint."""

from __future__ import annotations

import argparse
import sys

__all__ = ["configure", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="dist_command", metavar="ACTION", required=True)
    p = sub.add_parser("consolidate", help="gather a sharded checkpoint (any world size) into a plain plyx "
                       "checkpoint: loadable by plyx serve, resumable by a single-process plyx train")
    p.add_argument("checkpoint", help="a sharded checkpoint directory, or a run / checkpoints directory (its latest)")
    p.add_argument("out", help="the new plain checkpoint directory (must not exist)")


def run(args: argparse.Namespace) -> int:
    from plyx.dist._checkpoint import consolidate
    from plyx.train import ResumeError

    try:
        out = consolidate(args.checkpoint, args.out)
    except (ValueError, FileExistsError, FileNotFoundError, ResumeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"consolidated {args.checkpoint} -> {out}")
    return 0
