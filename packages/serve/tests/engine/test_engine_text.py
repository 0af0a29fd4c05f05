"""The engine with a tokenizer: text, stop strings and structured output (xgrammar) inside a batch."""

from __future__ import annotations

import json

from plyx.serve import SamplingParams, StructuredOutput
from plyx.serve.engine import Engine, EngineConfig


def make(bpe_lm, bpe, **kw):
    return Engine(bpe_lm, tokenizer=bpe, config=EngineConfig(max_batch_size=8, max_batch_tokens=64, block_size=4,
                                                             num_blocks=256, **kw))


def test_structured_json_schema_rows_next_to_free_rows(bpe_lm, bpe):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                               "ok": {"type": "boolean"}}, "required": ["answer", "ok"],
              "additionalProperties": False}
    engine = make(bpe_lm, bpe)
    prompt = bpe.encode("hello world").ids
    free = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    constrained = SamplingParams(temperature=0.8, seed=3, max_new_tokens=40,
                                 structured=StructuredOutput(json_schema=schema))
    outs = engine.generate([prompt, prompt, prompt], [free, constrained, free])
    value = json.loads(outs[1].outputs[0].text)
    assert value["answer"] in ("yes", "no") and isinstance(value["ok"], bool) and set(value) == {"answer", "ok"}
    assert outs[1].outputs[0].finish_reason == "stop"
    # the unconstrained rows are untouched by their neighbour's grammar
    alone = make(bpe_lm, bpe).generate([prompt], free)[0].outputs[0]
    assert outs[0].outputs[0].token_ids == outs[2].outputs[0].token_ids == alone.token_ids


def test_text_and_stop_strings(bpe_lm, bpe):
    engine = make(bpe_lm, bpe)
    prompt = bpe.encode("the quick brown fox").ids
    full = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True))[0].outputs[0]
    assert full.text == bpe.decode(list(full.token_ids))
    stop = full.text[5:8]
    cut = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=24, stop=(stop,),
                                                   ignore_eos=True))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[:full.text.find(stop)]
