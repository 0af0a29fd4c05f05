"""Detokenising a stream: host time of ``Completion.add`` per engine step (every row's new token), by length.

The engine thread turns each row's new token into text (``Completion.add``) at every step; with the whole
completion decoded again at each token that cost grows with the output (O(n) per token), with a window of
the newest tokens (incremental detokenisation) it stays flat. Measured in thread CPU time (a shared machine's
other processes do not count) over ``--rows`` completions of ``--tokens`` random ids through a byte-level BPE
of ``serving.py``'s kind (vocabulary 1024).

    python packages/serve/bench/bench_detokenize.py --tokens 512

Printed, and appended as a JSON line to ``bench/results/detokenize-cpu.jsonl``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import RESULTS


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=512, help="tokens per completion")
    p.add_argument("--rows", type=int, default=32, help="completions (rows of one engine step)")
    p.add_argument("--label", default="", help="what code was measured (kept in the JSON line)")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    from plyx.serve import SamplingParams
    from plyx.serve._completion import Completion
    from plyx.serve._tokenizer import TokenizerView
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    words = [f"w{i} x{i % 97} y{i % 13}" for i in range(4000)]
    tok.train_from_iterator(words, trainers.BpeTrainer(vocab_size=1024, show_progress=False,
                                                       special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    view = TokenizerView(tok)
    rng = random.Random(0)
    rows = [[rng.randrange(8, 1024) for _ in range(args.tokens)] for _ in range(args.rows)]
    params = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)
    comps = [Completion(request_index=0, index=0, prompt_ids=[1], params=params, stop_ids=[], context=10**6,
                        tokenizer=view, seq_id=i, generator=None) for i in range(args.rows)]
    per_step = []
    for t in range(args.tokens):  # one engine step: every row takes its token
        start = time.thread_time()
        for c, ids in zip(comps, rows):
            c.add([ids[t]])
        per_step.append(time.thread_time() - start)
    assert all(c.output().text == view.decode(ids) for c, ids in zip(comps, rows))  # the text is unchanged
    mean_ms = sum(per_step) * 1e3 / len(per_step)
    last = per_step[-max(1, len(per_step) // 16):]
    row = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "device": platform.processor() or "cpu", "label": args.label, "rows": args.rows, "tokens": args.tokens,
           "ms_per_step_mean": mean_ms, "ms_per_step_last": sum(last) * 1e3 / len(last)}
    print(f"{row['device']}, {row['date']}: {args.rows} rows x {args.tokens} tokens: Completion.add per engine step "
          f"{mean_ms:.3f} ms mean, {row['ms_per_step_last']:.3f} ms over the last 1/16 (thread CPU time)")
    RESULTS.mkdir(exist_ok=True)
    path = Path(args.out) if args.out else RESULTS / "detokenize-cpu.jsonl"
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
