"""The tool-call parsers on hand-written model outputs: the calls and content they find, and
their stream's deltas, split anywhere, accumulated by the `openai` client's own stream state,
against the non-streamed message."""

from __future__ import annotations

import json
import random

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from pipeserve.runtime.serving.tool_calls import ChoiceToolCalls, named_schema, parse_tool_calls, required_schema

WEATHER = '{"city": "Paris", "unit": "celsius"}'

# (parser, model output, expected content, expected [(name, arguments object)])
CASES = [
    ("hermes", f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>',
     None, [("get_weather", json.loads(WEATHER))]),
    ("hermes", f'Let me look.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
     "Let me look.", [("get_weather", json.loads(WEATHER)), ("get_time", {"zone": "CET"})]),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {"zone": "<UTC>"}}</tool_call> Done.',
     " Done.", [("get_time", {"zone": "<UTC>"})]),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}',  # unclosed at the end
     None, [("get_time", {"zone": "UTC"})]),
    ("hermes", "The weather in Paris is mild, 3 < 4 and <tool not a call.\n", "The weather in Paris is mild, "
               "3 < 4 and <tool not a call.\n", []),
    ("hermes", "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ("llama3_json", f'{{"name": "get_weather", "parameters": {WEATHER}}}', None,
     [("get_weather", json.loads(WEATHER))]),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "arguments": {"zone": "UTC"}}; '
                    '{"name": "get_time", "parameters": {"zone": "CET"}}',
     None, [("get_time", {"zone": "UTC"}), ("get_time", {"zone": "CET"})]),
    ("llama3_json", "It is sunny in {Paris}.", "It is sunny in {Paris}.", []),
    ("llama3_json", '{"name": "get_time", "parameters": {"zone": "UTC"}} and more', '{"name": "get_time", '
                    '"parameters": {"zone": "UTC"}} and more', []),
    ("llama3_json", "  <|python", "  <|python", []),
]


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_parser_finds_the_calls(parser, text, content, calls):
    got_content, got_calls = parse_tool_calls(parser, text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls


def _chunk(delta: dict, finish_reason: str | None = None) -> ChatCompletionChunk:
    return ChatCompletionChunk.model_validate({
        "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]})


def _streamed(reader: ChoiceToolCalls, pieces: list[str]):
    """The message the openai client accumulates from the reader's deltas of ``pieces``."""
    state = ChatCompletionStreamState()
    state.handle_chunk(_chunk({"role": "assistant", "content": ""}))
    deltas = [d for piece in pieces for d in reader.feed(piece)] + reader.finish()
    for delta in deltas:
        state.handle_chunk(_chunk(delta))
    state.handle_chunk(_chunk({}, "tool_calls" if reader.num_calls else "stop"))
    return state.get_final_completion().choices[0].message


def _splits(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_streamed_deltas_add_up_to_the_message(parser, text, content, calls):
    rng = random.Random(hash(text) % 1000)
    content, expected = ChoiceToolCalls("auto", parser=parser).message(text)
    for pieces in [[text], list(text), *(_splits(text, rng) for _ in range(20))]:
        message = _streamed(ChoiceToolCalls("auto", parser=parser), pieces)
        assert (message.content or None) == content
        got = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
        assert got == [(c["function"]["name"], c["function"]["arguments"]) for c in expected]
        assert all(c.id.startswith("chatcmpl-tool-") and c.type == "function" for c in message.tool_calls or [])


def test_parallel_tool_calls_false_keeps_the_first_call():
    content, calls = ChoiceToolCalls("auto", parser="hermes", parallel=False).message(CASES[1][1])
    assert content == "Let me look." and [c["function"]["name"] for c in calls] == ["get_weather"]


def test_named_function_streams_its_arguments():
    message = _streamed(ChoiceToolCalls("named", function="get_weather"), ['{"city"', ': "Paris"', "}"])
    assert message.content in ("", None)
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')]


def test_required_output_and_its_schema():
    import jsonschema

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
             {"type": "function", "function": {"name": "get_time"}}]
    output = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    jsonschema.validate(json.loads(output), required_schema(tools, parallel=True))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(output), required_schema(tools, parallel=False))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {}}],
                            required_schema(tools, parallel=True))
    assert named_schema(tools, "get_time") == {"type": "object"}
    content, calls = ChoiceToolCalls("required").message(output)
    assert content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert ChoiceToolCalls("required").message('[{"name": "get_we') == ('[{"name": "get_we', [])  # cut short
