"""Verifiable tasks for post-training demonstrations: generated, exactly checkable, with a fixed held-out split.

Four kinds, each a short prompt with one correct answer:

- ``add``: ``add 23 58`` -> ``81`` (two numbers below 100);
- ``reverse``: ``reverse kite`` -> ``etik`` (3-5 letters);
- ``sort``: ``sort 5 2 9 1`` -> ``1 2 5 9`` (4 digits);
- ``date``: ``date 2024-03-07`` -> ``07/03/2024`` (ISO to day/month/year).

The split is a property of the prompt (a hash), not of the draw: a prompt is held out
(``test``) exactly when ``sha256(prompt) % 10 == 0``, so no seed or sample size can leak a
test prompt into training. Accuracy is exact string match of the greedy completion.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from typing import Any, Literal

import attrs
import torch

__all__ = ["TASK_KINDS", "Task", "corrupt", "make_tasks", "score", "greedy_answers", "split_of"]

TASK_KINDS = ("add", "reverse", "sort", "date")
Split = Literal["train", "test"]
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


@attrs.frozen
class Task:
    """One task: its kind, the prompt text and the only correct answer."""

    kind: str
    prompt: str
    answer: str

    def messages(self, answer: str | None = None) -> list[dict[str, str]]:
        """The chat form: a user turn with the prompt, and the assistant's ``answer`` (default: the correct one)."""
        return [{"role": "user", "content": self.prompt},
                {"role": "assistant", "content": self.answer if answer is None else answer}]


def split_of(prompt: str) -> Split:
    """``test`` for one prompt in ten (by hash), else ``train``."""
    return "test" if int(hashlib.sha256(prompt.encode()).hexdigest(), 16) % 10 == 0 else "train"


def _draw(kind: str, rng: random.Random) -> Task:
    if kind == "add":
        a, b = rng.randrange(100), rng.randrange(100)
        return Task(kind, f"add {a} {b}", str(a + b))
    if kind == "reverse":
        word = "".join(rng.choice(_LETTERS) for _ in range(rng.randint(3, 5)))
        return Task(kind, f"reverse {word}", word[::-1])
    if kind == "sort":
        digits = [rng.randrange(10) for _ in range(4)]
        return Task(kind, "sort " + " ".join(map(str, digits)), " ".join(map(str, sorted(digits))))
    if kind == "date":
        y, m, d = rng.randint(1990, 2030), rng.randint(1, 12), rng.randint(1, 28)
        return Task(kind, f"date {y:04d}-{m:02d}-{d:02d}", f"{d:02d}/{m:02d}/{y:04d}")
    raise ValueError(f"unknown task kind {kind!r}; choose from {', '.join(TASK_KINDS)}")


def make_tasks(n: int, *, split: Split, seed: int = 0, kinds: Sequence[str] = TASK_KINDS) -> list[Task]:
    """``n`` distinct tasks of ``split``, kinds in rotation, drawn with ``seed``.

    Raises:
        ValueError: an unknown kind, or ``n`` larger than the split can supply.
    """
    rng = random.Random(f"{seed}-{split}")
    out: list[Task] = []
    seen: set[str] = set()
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 200 * n + 1000:
            raise ValueError(f"cannot draw {n} distinct {split} tasks of kinds {list(kinds)}; ask for fewer")
        task = _draw(kinds[len(out) % len(kinds)], rng)
        if task.prompt in seen or split_of(task.prompt) != split:
            continue
        seen.add(task.prompt)
        out.append(task)
    return out


def corrupt(task: Task, rng: random.Random) -> str:
    """A wrong answer close to the right one: one character changed, or two swapped."""
    answer = task.answer
    for _ in range(100):
        chars = list(answer)
        positions = [i for i, c in enumerate(chars) if c.isalnum()]
        i = rng.choice(positions)
        if rng.random() < 0.5 and len(positions) > 1:
            j = rng.choice([p for p in positions if p != i])
            chars[i], chars[j] = chars[j], chars[i]
        else:
            pool = "0123456789" if chars[i].isdigit() else _LETTERS
            chars[i] = rng.choice([c for c in pool if c != chars[i]])
        wrong = "".join(chars)
        if wrong != answer:
            return wrong
    return answer + "0"


@torch.no_grad()
def greedy_answers(model: Any, tokenizer: Any, template: Any, tasks: Sequence[Task], *, max_new_tokens: int = 12,
                   stop_tokens: Sequence[str] = ("<|im_end|>",), batch_size: int = 64) -> list[str]:
    """Each task's greedy answer: the chat prompt with the generation prompt, decoded until a stop token.

    Prompts are left-padded in batches (``attention_mask``); every step re-runs the full forward, which
    is cheap at these lengths and needs nothing beyond plyx-model.
    """
    device = next(model.parameters()).device
    stops = {int(tokenizer.eos_id)}
    vocab = tokenizer.inner.get_vocab(with_added_tokens=True)
    stops.update(int(vocab[s]) for s in stop_tokens if s in vocab)
    was = model.training
    model.eval()
    answers: list[str] = []
    try:
        for start in range(0, len(tasks), batch_size):
            chunk = tasks[start: start + batch_size]
            prompts = [tokenizer.encode(template.render([{"role": "user", "content": t.prompt}],
                                                        add_generation_prompt=True)) for t in chunk]
            width = max(map(len, prompts))
            ids = torch.full((len(chunk), width), int(tokenizer.eos_id), dtype=torch.long)  # (B, T) left-padded
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, p in enumerate(prompts):
                ids[row, width - len(p):] = torch.tensor(p)
                mask[row, width - len(p):] = 1
            ids, mask = ids.to(device), mask.to(device)
            done = torch.zeros(len(chunk), dtype=torch.bool, device=device)
            out: list[list[int]] = [[] for _ in chunk]
            for _ in range(max_new_tokens):
                logits = model(ids, attention_mask=mask)[:, -1]  # (B, V)
                nxt = logits.argmax(-1)
                for row in range(len(chunk)):
                    if not done[row]:
                        tok = int(nxt[row])
                        if tok in stops:
                            done[row] = True
                        else:
                            out[row].append(tok)
                if bool(done.all()):
                    break
                ids = torch.cat([ids, nxt[:, None]], dim=1)
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            answers += [tokenizer.decode(o).strip() for o in out]
    finally:
        model.train(was)
    return answers


def score(answers: Sequence[str], tasks: Sequence[Task]) -> dict[str, float]:
    """Exact-match accuracy overall and per kind."""
    result: dict[str, float] = {}
    kinds: dict[str, list[bool]] = {}
    for a, t in zip(answers, tasks):
        kinds.setdefault(t.kind, []).append(a == t.answer)
    total = [ok for oks in kinds.values() for ok in oks]
    result["accuracy"] = sum(total) / max(1, len(total))
    for k, oks in sorted(kinds.items()):
        result[f"accuracy/{k}"] = sum(oks) / len(oks)
    return result
