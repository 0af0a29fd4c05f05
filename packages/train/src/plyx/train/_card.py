"""What a trained checkpoint says about itself: its model card fields and its tokenizer config (chat template).

The card is named after the run (the ``out_dir``'s name, ``shakespeare`` for
``runs/shakespeare``) unless ``--name`` says otherwise; its description states
the architecture, size, data, steps and final losses; its licence is what
``--license`` gives, else ``NOASSERTION`` (SPDX for "nobody stated one").

``tokenizer_config.json`` gives the checkpoint a chat template so that
``plyx serve`` answers ``/v1/chat/completions`` on it: ``role: content`` lines
ending with ``assistant:`` (plyx-serve's builtin ``plain``). A model trained on
plain text has never seen this format; it continues the transcript as best it
can, which is what a base model does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_CHAT_TEMPLATE", "DEFAULT_LICENSE", "card_fields", "tokenizer_config"]

#: the chat template written into trained checkpoints (the same text as plyx-serve's builtin ``plain``)
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)
#: SPDX's "no licence was stated" (``--license`` sets a real one)
DEFAULT_LICENSE = "NOASSERTION"


def _data_name(data_path: str, data_dir: Path, source: dict[str, Any]) -> str:
    if not data_path:
        return "the bundled Tiny Shakespeare (public domain)"
    corpus = source.get("corpus")
    return f"{corpus or data_path}"


def card_fields(
    *,
    run_name: str,
    config: Any,
    num_params: int,
    step: int,
    metrics: dict[str, float],
    data_dir: Path,
    source: dict[str, Any],
    name: str | None = None,
    license: str | None = None,
    description: str | None = None,
) -> dict[str, Any]:
    """``name``, ``license`` and ``description`` of a trained checkpoint's ``ModelCard``.

    Args:
        run_name: the run directory's name (the default model name).
        config: the run's ``TrainConfig``.
        num_params: parameters of the model.
        step: the step saved.
        metrics: the last metrics (``val_loss``, ``loss``, ``tokens``).
        data_dir: the prepared data directory.
        source: its manifest's ``source`` record.
        name / license / description: what the user set (None: derived).

    Returns:
        the card fields.
    """
    m = config.model
    losses = []
    if metrics.get("loss") is not None:
        losses.append(f"training loss {metrics['loss']:.4f}")
    if metrics.get("val_loss") is not None:
        losses.append(f"validation loss {metrics['val_loss']:.4f}")
    tokens = metrics.get("tokens")
    derived = (
        f"A {num_params / 1e6:.2f}M-parameter {m.arch} language model ({m.n_layers} layers, d_model {m.d_model}, "
        f"vocabulary {m.vocab_size}) trained from scratch by plyx-train on "
        f"{_data_name(config.data.path, data_dir, source)} for {step} of {config.steps} steps"
        + (f" ({int(tokens):,} tokens)" if tokens else "")
        + (f"; {', '.join(losses)}" if losses else "")
        + ". A small base model for experiments: it continues text and is not instruction-tuned."
    )
    return {
        "name": name or run_name,
        "license": license or DEFAULT_LICENSE,
        "description": description or derived,
    }


def tokenizer_config(*, eos_token: str, max_len: int, chat_template: str = DEFAULT_CHAT_TEMPLATE) -> dict[str, Any]:
    """The ``tokenizer_config.json`` of a trained checkpoint (loadable by transformers' ``AutoTokenizer`` too).

    Args:
        eos_token: the tokenizer's end-of-document token (serving stops on it).
        max_len: the model's context length.
        chat_template: the Jinja chat template.

    Returns:
        the JSON document.
    """
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos_token,
        "model_max_length": max_len,
        "chat_template": chat_template,
    }
