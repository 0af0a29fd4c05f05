"""Post-training data: JSONL records -> token ids with loss masks -> ``plyx.specs.Batch``.

Record kinds (one JSON object per line):

- ``{"messages": [{"role": ..., "content": ...}, ...]}``: a conversation, rendered with the chat template;
  the loss covers the assistant's tokens only (or every token with ``assistant_only_loss = false``).
- ``{"prompt": ..., "completion": ...}``: completion-only SFT; strings are concatenated as they are
  (the completion followed by the end-of-text token), a list of messages as ``prompt`` is rendered with the
  template's generation prompt and the completion (a string or one assistant message) is the assistant turn.
- ``{"text": ...}``: plain text, loss on every token (continued pretraining).
- ``{"prompt", "chosen", "rejected"}``: a preference pair (DPO, ORPO, SimPO).
- ``{"prompt", "completion", "label"}``: an unpaired KTO example (``label`` true = desirable).

Bad records: malformed JSON or a missing field is a ``DataError`` naming the file and line; records that
are valid but unusable (no assistant turn, chosen == rejected, too long under ``truncation = "skip"``) are
skipped and counted in a ``DataReport``, or raise with ``strict``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import attrs
import torch
from plyx.rl._chat import ChatTemplate, ChatTemplateError
from plyx.specs import Batch

__all__ = [
    "DataError",
    "DataReport",
    "KTOExample",
    "PairExample",
    "SFTExample",
    "TokenizedData",
    "collate_sft",
    "completion_rows",
    "pack_sft",
    "read_jsonl",
    "tokenize_kto",
    "tokenize_pairs",
    "tokenize_sft",
]

IGNORE = -100
Truncation = Literal["skip", "truncate", "error"]


class DataError(ValueError):
    """A data file or record cannot be used; the message names the file, the line and the fix."""


@attrs.define
class DataReport:
    """What happened to the records of one file.

    Attributes:
        path: the file.
        records: records read.
        kept: examples produced.
        skipped: reason -> count of skipped records.
        truncated: examples cut to ``max_length``.
        first_skips: ``(line, reason)`` of the first few skips, for the log.
    """

    path: str
    records: int = 0
    kept: int = 0
    skipped: dict[str, int] = attrs.field(factory=dict)
    truncated: int = 0
    first_skips: list[tuple[int, str]] = attrs.field(factory=list)

    def skip(self, line: int, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        if len(self.first_skips) < 5:
            self.first_skips.append((line, reason))

    def summary(self) -> str:
        parts = [f"{self.kept} of {self.records} records kept"]
        if self.skipped:
            parts.append("skipped: " + ", ".join(f"{n} {reason}" for reason, n in sorted(self.skipped.items())))
        if self.truncated:
            parts.append(f"{self.truncated} truncated")
        return f"{self.path}: " + "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "records": self.records, "kept": self.kept, "skipped": dict(self.skipped),
                "truncated": self.truncated, "first_skips": [list(s) for s in self.first_skips]}


@attrs.frozen
class SFTExample:
    """Token ids and, per token, whether the loss covers it."""

    ids: tuple[int, ...]
    loss_mask: tuple[bool, ...]


@attrs.frozen
class PairExample:
    """A prompt with a chosen and a rejected completion (ids; the completions end with their end token)."""

    prompt: tuple[int, ...]
    chosen: tuple[int, ...]
    rejected: tuple[int, ...]
    margin: float = 0.0
    """The record's optional ``margin`` (how much better chosen is; reward-model training uses it)."""


@attrs.frozen
class KTOExample:
    """A prompt, one completion and whether it is desirable."""

    prompt: tuple[int, ...]
    completion: tuple[int, ...]
    desirable: bool


@attrs.frozen
class TokenizedData:
    """Examples of one file and the report of how they were made."""

    examples: list[Any]
    report: DataReport


# -- reading ----------------------------------------------------------------------------
def read_jsonl(path: str | os.PathLike[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, record)`` of every non-blank line.

    Raises:
        DataError: the file is missing, a line is not JSON, or not a JSON object (file and line named).
    """
    p = Path(path)
    if not p.is_file():
        raise DataError(f"data file {str(p)!r} does not exist; point `data` at a JSONL file")
    with p.open(encoding="utf-8") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{p}:{number}: malformed JSON ({exc.msg} at column {exc.colno}); "
                                "each line must be one JSON object") from None
            if not isinstance(record, dict):
                raise DataError(f"{p}:{number}: expected a JSON object, got {type(record).__name__}")
            yield number, record


def _need(record: dict[str, Any], key: str, where: str, kinds: tuple[type, ...] = (str, list)) -> Any:
    if key not in record:
        raise DataError(f"{where}: missing field {key!r} (has {', '.join(sorted(record)) or 'none'})")
    value = record[key]
    if not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise DataError(f"{where}: field {key!r} must be {names}, got {type(value).__name__}")
    return value


def _check_messages(messages: Any, where: str, key: str = "messages") -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: {key!r} must be a non-empty list of {{role, content}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: {key}[{i}] must be an object with string 'role' and 'content'")
    return messages


# -- tokenizing -------------------------------------------------------------------------
class _Encoder:
    """Text -> ids (and offsets) with a ``plyx.train.Tokenizer`` and an optional chat template."""

    def __init__(self, tokenizer: Any, template: ChatTemplate | None) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.eos_id = int(tokenizer.eos_id)

    def need_template(self, where: str) -> ChatTemplate:
        if self.template is None:
            raise DataError(f"{where}: a conversation needs a chat template, and none was found: add "
                            "chat_template.jinja or tokenizer_config.json's chat_template beside tokenizer.json, "
                            "or set chat_template in the config")
        return self.template

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.inner.encode(text, add_special_tokens=False).ids)

    def conversation(self, messages: list[dict[str, Any]], assistant_only: bool, where: str) -> SFTExample:
        rendered = self.need_template(where).render_with_spans(messages)
        enc = self.tokenizer.inner.encode(rendered.text, add_special_tokens=False)
        mask = []
        for start, _end in enc.offsets:
            mask.append(not assistant_only or any(a <= start < b for a, b in rendered.spans))
        return SFTExample(tuple(enc.ids), tuple(mask))

    def prompt_completion(self, prompt: Any, completion: Any, where: str) -> tuple[list[int], list[int]]:
        """Prompt ids and completion ids (ending with its end-of-turn / end-of-text token)."""
        if isinstance(prompt, str):
            if not isinstance(completion, str):
                raise DataError(f"{where}: with a string prompt the completion must be a string too")
            return self.encode(prompt), self.encode(completion) + [self.eos_id]
        messages = _check_messages(prompt, where, "prompt")
        if isinstance(completion, list):
            turns = _check_messages(completion, where, "completion")
            if len(turns) != 1 or turns[0]["role"] != "assistant":
                raise DataError(f"{where}: a conversational completion must be one assistant message")
            completion = turns[0]["content"]
        template = self.need_template(where)
        head = template.render(messages, add_generation_prompt=True)
        full = template.render([*messages, {"role": "assistant", "content": completion}])
        if not full.startswith(head):
            raise DataError(f"{where}: the chat template's render of the prompt with the generation prompt is not "
                            "a prefix of the render with the completion; the template cannot split prompt and "
                            "completion")
        return self.encode(head), self.encode(full[len(head):])


def _truncate_sft(ex: SFTExample, max_length: int, policy: Truncation, where: str, report: DataReport
                  ) -> SFTExample | None:
    """``ex`` within ``max_length`` under ``policy``; None when it is to be skipped (``too_long``)."""
    if len(ex.ids) <= max_length:
        return ex
    if policy == "error":
        raise DataError(f"{where}: {len(ex.ids)} tokens exceed max_length {max_length}; raise max_length or set "
                        "truncation = 'skip' or 'truncate'")
    if policy == "skip":
        return None
    report.truncated += 1
    return SFTExample(ex.ids[:max_length], ex.loss_mask[:max_length])


def _line(where: str) -> int:
    return int(where.rsplit(":", 1)[-1])


def tokenize_sft(path: str | os.PathLike[str], tokenizer: Any, template: ChatTemplate | None, *, max_length: int,
                 truncation: Truncation = "skip", assistant_only_loss: bool = True, strict: bool = False
                 ) -> TokenizedData:
    """SFT examples of a JSONL file (``messages``, ``prompt``/``completion`` or ``text`` records).

    Args:
        tokenizer: a ``plyx.train.Tokenizer``.
        template: the chat template (needed by ``messages`` records and conversational prompts).
        max_length: the longest example in tokens.
        truncation: ``skip`` (count and drop) | ``truncate`` (keep the first max_length tokens) | ``error``.
        assistant_only_loss: loss on the assistant's tokens only (conversations).
        strict: raise on the first record that would be skipped.
    """
    enc = _Encoder(tokenizer, template)
    report = DataReport(str(path))
    out: list[SFTExample] = []
    for number, record in read_jsonl(path):
        report.records += 1
        where = f"{path}:{number}"
        reason = None
        if "messages" in record:
            messages = _check_messages(record["messages"], where)
            if not any(m["role"] == "assistant" for m in messages):
                reason = "no_assistant_turn"
            else:
                try:
                    ex = enc.conversation(messages, assistant_only_loss, where)
                except ChatTemplateError as exc:
                    raise DataError(f"{where}: {exc}") from None
        elif "prompt" in record or "completion" in record:
            prompt = _need(record, "prompt", where)
            completion = _need(record, "completion", where)
            p, c = enc.prompt_completion(prompt, completion, where)
            ex = SFTExample(tuple(p + c), (False,) * len(p) + (True,) * len(c))
        elif "text" in record:
            text = _need(record, "text", where, (str,))
            ids = enc.encode(text) + [enc.eos_id]
            ex = SFTExample(tuple(ids), (True,) * len(ids))
        else:
            raise DataError(f"{where}: an SFT record needs 'messages', 'prompt' + 'completion', or 'text' "
                            f"(has {', '.join(sorted(record)) or 'no fields'})")
        if reason is None:
            fitted = _truncate_sft(ex, max_length, truncation, where, report)
            if fitted is None:
                reason = "too_long"
            elif not any(fitted.loss_mask[1:]):  # the first token is never predicted
                reason = "no_loss_tokens"
            else:
                out.append(fitted)
                continue
        report.skip(number, reason)
        if strict:
            raise DataError(f"{where}: record skipped ({reason}); fix the record or drop `--strict`")
    report.kept = len(out)
    _check_not_empty(report)
    return TokenizedData(out, report)


def _check_not_empty(report: DataReport) -> None:
    if report.kept == 0:
        raise DataError(f"{report.summary()}: no usable example; see the skip reasons")


def _fit_pair(prompt: list[int], completions: Sequence[list[int]], max_length: int, policy: Truncation,
              where: str, report: DataReport) -> tuple[list[int], list[list[int]]] | None:
    """Apply the truncation policy to a prompt and its completions (each row is prompt + one completion)."""
    longest = max(len(c) for c in completions)
    if len(prompt) + longest <= max_length:
        return prompt, list(completions)
    if policy == "error":
        raise DataError(f"{where}: prompt + completion of {len(prompt) + longest} tokens exceed max_length "
                        f"{max_length}; raise max_length or set truncation = 'skip' or 'truncate'")
    if policy == "skip":
        report.skip(_line(where), "too_long")
        return None
    report.truncated += 1
    # keep the end of the prompt (what the completion answers), at least half the budget if it is that long
    keep = max(max_length - longest, min(len(prompt), max_length // 2))
    prompt = prompt[-keep:] if keep > 0 else []
    room = max_length - len(prompt)
    return prompt, [c[:room] for c in completions]


def tokenize_pairs(path: str | os.PathLike[str], tokenizer: Any, template: ChatTemplate | None, *, max_length: int,
                   truncation: Truncation = "skip", strict: bool = False) -> TokenizedData:
    """Preference pairs ``{"prompt", "chosen", "rejected"}`` of a JSONL file."""
    enc = _Encoder(tokenizer, template)
    report = DataReport(str(path))
    out: list[PairExample] = []
    for number, record in read_jsonl(path):
        report.records += 1
        where = f"{path}:{number}"
        prompt = _need(record, "prompt", where)
        chosen = _need(record, "chosen", where)
        rejected = _need(record, "rejected", where)
        margin = record.get("margin", 0.0)
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or margin != margin:
            raise DataError(f"{where}: 'margin' must be a number (got {margin!r}); drop it or write e.g. 1.5")
        if chosen == rejected:
            report.skip(number, "chosen_equals_rejected")
            if strict:
                raise DataError(f"{where}: chosen and rejected are the same completion; a pair must differ "
                                "(fix the record or drop `--strict` to skip it)")
            continue
        p, c = enc.prompt_completion(prompt, chosen, where)
        _, r = enc.prompt_completion(prompt, rejected, where)
        fitted = _fit_pair(p, [c, r], max_length, truncation, where, report)
        if fitted is None:
            if strict:
                raise DataError(f"{where}: record skipped (too_long); fix the record or drop `--strict`")
            continue
        p, (c, r) = fitted
        if c == r:
            report.skip(number, "chosen_equals_rejected_after_truncation")
            continue
        out.append(PairExample(tuple(p), tuple(c), tuple(r), float(margin)))
    report.kept = len(out)
    _check_not_empty(report)
    return TokenizedData(out, report)


def tokenize_kto(path: str | os.PathLike[str], tokenizer: Any, template: ChatTemplate | None, *, max_length: int,
                 truncation: Truncation = "skip", strict: bool = False) -> TokenizedData:
    """Unpaired KTO examples ``{"prompt", "completion", "label"}`` of a JSONL file."""
    enc = _Encoder(tokenizer, template)
    report = DataReport(str(path))
    out: list[KTOExample] = []
    for number, record in read_jsonl(path):
        report.records += 1
        where = f"{path}:{number}"
        prompt = _need(record, "prompt", where)
        completion = _need(record, "completion", where)
        label = _need(record, "label", where, (bool,))
        p, c = enc.prompt_completion(prompt, completion, where)
        fitted = _fit_pair(p, [c], max_length, truncation, where, report)
        if fitted is None:
            if strict:
                raise DataError(f"{where}: record skipped (too_long); fix the record or drop `--strict`")
            continue
        p, (c,) = fitted
        out.append(KTOExample(tuple(p), tuple(c), bool(label)))
    report.kept = len(out)
    _check_not_empty(report)
    if all(e.desirable for e in out) or not any(e.desirable for e in out):
        kind = "desirable" if out[0].desirable else "undesirable"
        raise DataError(f"{path}: every KTO example is {kind}; KTO needs both labels (true and false)")
    return TokenizedData(out, report)


# -- batches ----------------------------------------------------------------------------
def _targets(ex: SFTExample) -> list[int]:
    """Next-token targets of one example: ids[t + 1] where the loss covers it, else -100; the last is -100."""
    ids, mask = ex.ids, ex.loss_mask
    return [ids[t + 1] if mask[t + 1] else IGNORE for t in range(len(ids) - 1)] + [IGNORE]


def collate_sft(examples: Sequence[SFTExample], pad_id: int) -> Batch:
    """One example per row, right-padded to the longest (padding is causal-invisible: it comes after)."""
    width = max(len(e.ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)  # (B, T)
    targets = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    for row, ex in enumerate(examples):
        ids[row, : len(ex.ids)] = torch.tensor(ex.ids)
        targets[row, : len(ex.ids)] = torch.tensor(_targets(ex))
    return Batch(ids, targets)


def pack_sft(examples: Sequence[SFTExample], max_length: int, pad_id: int) -> list[tuple[list[int], list[int], list[int]]]:
    """Greedy in-order packing into rows of at most ``max_length`` tokens.

    Returns rows of ``(ids, targets, document_ids)``; each example keeps its own targets (the last token of
    a document predicts nothing), and ``document_ids`` make attention stop at every boundary.
    """
    rows: list[tuple[list[int], list[int], list[int]]] = []
    ids: list[int] = []
    targets: list[int] = []
    docs: list[int] = []
    for ex in examples:
        if ids and len(ids) + len(ex.ids) > max_length:
            rows.append((ids, targets, docs))
            ids, targets, docs = [], [], []
        doc = docs[-1] + 1 if docs else 0
        ids += ex.ids
        targets += _targets(ex)
        docs += [doc] * len(ex.ids)
    if ids:
        rows.append((ids, targets, docs))
    return rows


def collate_packed(rows: Sequence[tuple[list[int], list[int], list[int]]], pad_id: int) -> Batch:
    """Packed rows -> a ``Batch`` with ``document_ids`` (padding is one more document of its own)."""
    width = max(len(r[0]) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # (B, T)
    targets = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    docs = torch.empty((len(rows), width), dtype=torch.long)
    for row, (i, t, d) in enumerate(rows):
        n = len(i)
        ids[row, :n] = torch.tensor(i)
        targets[row, :n] = torch.tensor(t)
        docs[row, :n] = torch.tensor(d)
        docs[row, n:] = (d[-1] + 1) if d else 0
    return Batch(ids, targets, document_ids=docs)


def completion_rows(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int) -> Batch:
    """Rows ``prompt + completion``, right-padded; targets only on the completion's tokens."""
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # (B, T)
    targets = torch.full((len(prompts), width), IGNORE, dtype=torch.long)
    for row, (p, c) in enumerate(zip(prompts, completions)):
        seq = list(p) + list(c)
        ids[row, : len(seq)] = torch.tensor(seq)
        if c:
            # position t predicts seq[t + 1]: the completion's tokens are predicted from len(p) - 1 on
            start = max(len(p) - 1, 0)
            tgt = seq[start + 1:] if p else seq[1:]
            targets[row, start: start + len(tgt)] = torch.tensor(tgt, dtype=torch.long)
    return Batch(ids, targets)
