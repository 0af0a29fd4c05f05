"""Opt-in receipts of served responses: the decoding settings and digests of what went in and out.

Set ``PLYX_SERVE_RECEIPTS`` to a directory and every response a plyx server
sends (answered, refused, cancelled) appends one JSON line to
``serve-receipts.jsonl`` there, through the ``plyx_on_response`` hook:

    schema, created, request_id, endpoint, model, decoding {temperature, top_p, top_k, seed,
    max_tokens, stop, penalties, logprobs...}, guardrail_policy, finish_reason, status, usage,
    prompt_sha256, response_sha256, techniques (when the server puts them in the context), content_id

Texts are recorded as sha256 digests only (never raw: prompts and replies may
hold personal data), enough to show that a reply replays under the same settings.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from plyx.governance._canonical import CONTENT_ID_FIELD, content_id
from plyx.governance._clock import utc_now
from plyx.governance._receipt import jsonable, techniques_record

__all__ = ["SERVE_RECEIPTS_ENV", "SERVE_RECEIPT_SCHEMA", "SERVE_RECEIPTS_FILE", "DECODING_KEYS", "serve_receipt",
           "record_response"]

SERVE_RECEIPTS_ENV = "PLYX_SERVE_RECEIPTS"
SERVE_RECEIPT_SCHEMA = "plyx.governance.serve_receipt/1"
SERVE_RECEIPTS_FILE = "serve-receipts.jsonl"
# request fields (OpenAI and plyx extensions) that decide what is generated
DECODING_KEYS = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "max_completion_tokens", "n",
                 "best_of", "stop", "frequency_penalty", "presence_penalty", "repetition_penalty", "logprobs",
                 "top_logprobs", "logit_bias", "response_format", "stream", "speculative", "use_beam_search")


def _sha256(text: Any) -> str | None:
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest() if isinstance(text, str) else None


def serve_receipt(request: Mapping[str, Any], response: Mapping[str, Any], context: Mapping[str, Any]) -> dict[str, Any]:
    """The receipt of one response (see the module docstring); no raw text."""
    prompt = request.get("prompt_text")
    if prompt is None and isinstance(request.get("messages"), list):
        prompt = json.dumps(request["messages"], sort_keys=True, ensure_ascii=False)
    record: dict[str, Any] = {
        "schema": SERVE_RECEIPT_SCHEMA,
        "created": utc_now(),
        "request_id": str(context.get("request_id", "")),
        "endpoint": str(context.get("endpoint", "")),
        "model": request.get("model"),
        "decoding": jsonable({k: request[k] for k in DECODING_KEYS if k in request}),
        "guardrail_policy": context.get("guardrail_policy") or None,
        "finish_reason": response.get("finish_reason"),
        "status": response.get("status"),
        "usage": jsonable(dict(response.get("usage") or {})),
        "prompt_sha256": _sha256(prompt),
        "response_sha256": _sha256(response.get("text")),
        "techniques": techniques_record(context.get("techniques")),
    }
    record[CONTENT_ID_FIELD] = content_id(record)
    return record


def record_response(request: Mapping[str, Any], response: Mapping[str, Any], context: Mapping[str, Any],
                    directory: str | os.PathLike[str] | None = None) -> Path | None:
    """Append the receipt of one response to ``directory`` (default ``$PLYX_SERVE_RECEIPTS``); None when off."""
    where = directory if directory is not None else os.environ.get(SERVE_RECEIPTS_ENV, "")
    if not where:
        return None
    out = Path(where)
    out.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(serve_receipt(request, response, context), sort_keys=True, ensure_ascii=False) + "\n").encode()
    path = out / SERVE_RECEIPTS_FILE
    # one write on an O_APPEND descriptor: concurrent responses never interleave within a line
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
    return path
