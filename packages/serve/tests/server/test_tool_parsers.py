"""Tool-call parsers: each family's format parsed to calls, malformed text left as content, and the
streamed split (content deltas + calls at the end) equal to the whole split at every chunking."""

from __future__ import annotations

import json

import pytest
from plyx.serve.server._tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ParsedCall,
    ToolStream,
    get_tool_parser,
)

W = ParsedCall("get_weather", json.dumps({"city": "Paris"}))
T = ParsedCall("get_time", json.dumps({"tz": "UTC", "h": 24}))

CASES = [
    # (parser, text, content, calls)
    (HermesParser, 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me look.", [W]),
    (HermesParser, '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n<tool_call>\n'
     '{"name": "get_time", "arguments": {"tz": "UTC", "h": 24}}', None, [W, T]),  # last block unclosed (EOS)
    (HermesParser, 'I think <tool_call>{"name": "get_weather", "arguments": {"city": ', None, []),  # cut: content
    (HermesParser, "no calls here < tool_call >", None, []),
    (Llama3JsonParser, '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [W]),
    (Llama3JsonParser, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
     '{"name": "get_time", "parameters": {"tz": "UTC", "h": 24}}', None, [W, T]),
    (Llama3JsonParser, '  {"name": "get_weather"', None, []),
    (Llama3JsonParser, "The weather is {sunny}.", None, []),
    (MistralParser, 'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
     '{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\", \\"h\\": 24}"}]', "Sure.", [W, T]),
    (MistralParser, '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "UTC", "h": 24}',
     None, [W, T]),
    (MistralParser, "[TOOL_CALLS] [{oops", None, []),
]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_parse(parser, text, content, calls):
    stream = ToolStream(parser())
    stream.feed(text)
    got_content, got_calls = stream.result()
    assert got_calls == calls
    # without calls the whole text is content (what the model wrote is never lost)
    assert got_content == (content if calls else text)
    for c in got_calls:
        assert isinstance(json.loads(c.arguments), dict)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_streamed_split_equals_the_whole(parser, text, content, calls, step):
    stream = ToolStream(parser())
    shown = "".join(stream.feed(text[i:i + step]) for i in range(0, len(text), step))
    rest, got_calls = stream.finish()
    whole_content, whole_calls = stream.result()
    assert shown + rest == (whole_content or "")
    assert got_calls == whole_calls == calls
    if calls:  # no part of a call marker or of the call leaked into the streamed content
        assert "tool_call" not in shown and "TOOL_CALLS" not in shown and "{" not in shown


def test_plain_content_streams_before_the_end():
    stream = ToolStream(HermesParser())
    assert stream.feed("Hello there, ") == "Hello there,"  # trailing space held: a call would strip it
    assert stream.feed("<tool") == ""  # may become <tool_call>
    assert stream.feed("box> is a word") == " <toolbox> is a word"
    assert stream.finish() == ("", [])


def test_parsers_are_plugins():
    assert isinstance(get_tool_parser("hermes"), HermesParser)
    assert isinstance(get_tool_parser("llama3_json"), Llama3JsonParser)
    with pytest.raises(ValueError, match="not found. It is either misspelled or not installed.*hermes"):
        get_tool_parser("hermez")
