"""The tool-call parsers on hand-written model outputs: the calls and content they find (the
arguments as json.dumps writes them), and their stream's deltas, split anywhere, accumulated by
the `openai` client's own stream state, against the non-streamed message; the arguments stream
as they are written, and text is held back only while it may still become a call."""

from __future__ import annotations

import json
import random
from functools import partial

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from pipeserve.runtime.serving.tool_calls import ChoiceToolCalls, named_schema, parse_tool_calls, required_schema

WEATHER = '{"city": "Paris", "unit": "celsius"}'
# Arguments as a model may write them: no spaces, escapes json.dumps does not write, a surrogate
# pair, numbers json writes otherwise, nesting and empty containers.
LOOSE = ('{"city":"Paris","note":"caf\\u00e9 \\/ \\"q\\"\\n\\ud83d\\ude00","temp":1.50,"exp":-2E+2,'
         '"zero":-0,"big":123456789012345678901234567890,"tags":[true,false,null,{},[]],"deep":{"a":[{"b":[]}]}}')


def dumped(arguments: str | dict) -> str:
    """The arguments text a call carries: json.dumps of the object, as vLLM writes it."""
    return json.dumps(json.loads(arguments) if isinstance(arguments, str) else arguments, ensure_ascii=False)


# (parser, model output, expected content, expected [(name, arguments text)])
CASES = [
    ("hermes", f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>',
     None, [("get_weather", dumped(WEATHER))]),
    ("hermes", f'Let me look.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
     "Let me look.", [("get_weather", dumped(WEATHER)), ("get_time", dumped({"zone": "CET"}))]),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {"zone": "<UTC>"}}</tool_call> Done.',
     " Done.", [("get_time", dumped({"zone": "<UTC>"}))]),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}',  # unclosed at the end
     None, [("get_time", dumped({"zone": "UTC"}))]),
    ("hermes", f'<tool_call>{{ "name" :"f",\n"arguments":\t{LOOSE} }}</tool_call>', None, [("f", dumped(LOOSE))]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"z": "a</tool_call>b"}}</tool_call>!', "!",
     [("f", dumped({"z": "a</tool_call>b"}))]),
    # A lone surrogate (which UTF-8 cannot carry) stays escaped.
    ("hermes", '<tool_call>{"name": "f", "arguments": {"s": "\\ud800x\\udc00"}}', None,
     [("f", '{"s": "\\ud800x\\udc00"}')]),
    ("hermes", '<tool_call>{"arguments": {"zone": "UTC"}, "name": "get_time"}</tool_call>',  # name last: whole
     None, [("get_time", dumped({"zone": "UTC"}))]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}, "id": 3} x</tool_call> y', " y", [("f", '{"a": 1}')]),
    # Once the head is read it is a call: broken JSON ends the arguments, a cut leaves them as they went.
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": [1, tru]}}</tool_call> after', " after",
     [("f", '{"a": [1, ')]),
    ("hermes", 'See <tool_call>{"name": "f", "arguments": {"n": 12', "See", [("f", '{"n": 12')]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"s": "\\u00', None, [("f", '{"s": "\\u00')]),
    # Text that starts like a call but is not one stays content.
    ("hermes", "The weather in Paris is mild, 3 < 4 and <tool not a call.\n", "The weather in Paris is mild, "
               "3 < 4 and <tool not a call.\n", []),
    ("hermes", "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ("hermes", '<tool_call>{"name": "Bob", "age": 3}</tool_call>', '<tool_call>{"name": "Bob", "age": 3}</tool_call>',
     []),
    ("hermes", '<tool_call>{"name": "f", "arguments": "a=1"}</tool_call>',
     '<tool_call>{"name": "f", "arguments": "a=1"}</tool_call>', []),
    ("hermes", '{"name": "f", "arguments": {}} <tool_ca', '{"name": "f", "arguments": {}} <tool_ca', []),
    ("llama3_json", f'{{"name": "get_weather", "parameters": {WEATHER}}}', None,
     [("get_weather", dumped(WEATHER))]),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "arguments": {"zone": "UTC"}}; '
                    '{"name": "get_time", "parameters": {"zone": "CET"}}',
     None, [("get_time", dumped({"zone": "UTC"})), ("get_time", dumped({"zone": "CET"}))]),
    ("llama3_json", f' {{"name":"f","parameters":{LOOSE}}};{{"parameters": {{}}, "name": "g"}}', None,
     [("f", dumped(LOOSE)), ("g", "{}")]),
    ("llama3_json", '{"name": "g", "parameters": {"x": [1, 2]}, "id": 7}', None, [("g", '{"x": [1, 2]}')]),
    ("llama3_json", "It is sunny in {Paris}.", "It is sunny in {Paris}.", []),
    ("llama3_json", '{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),
    # A call, then text that does not go on with calls: content from there on.
    ("llama3_json", '{"name": "get_time", "parameters": {"zone": "UTC"}} and more', " and more",
     [("get_time", dumped({"zone": "UTC"}))]),
    ("llama3_json", '{"name": "g", "parameters": {}}; {"name": "Bob", "age": 3}', '; {"name": "Bob", "age": 3}',
     [("g", "{}")]),
    ("llama3_json", '{"name": "g", "parameters": {"a": nul}} ; x', None, [("g", '{"a": ')]),
    ("llama3_json", "  <|python", "  <|python", []),
]


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_parser_finds_the_calls(parser, text, content, calls):
    got_content, got_calls = parse_tool_calls(parser, text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls


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
    """``text`` cut at a random number (1 to all) of random places."""
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, len(text) - 1)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def _accumulated(deltas: list[dict]) -> tuple[str | None, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) that the deltas add up to, each checked for OpenAI's form: a
    call's first delta has its index (the next), id, type and name; later ones only its index
    and more arguments."""
    content, calls = "", []
    for delta in deltas:
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            if "id" in call:
                assert call["index"] == len(calls) and call["type"] == "function"
                calls.append((call["function"]["name"], call["function"]["arguments"]))
            else:
                assert call["index"] == len(calls) - 1 and set(call["function"]) == {"arguments"}
                calls[-1] = (calls[-1][0], calls[-1][1] + call["function"]["arguments"])
    return content or None, calls


def _check_streams(reader, text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    """However ``text`` is split, its stream adds up to the expected message: by the openai
    client's own accumulation for the whole text, a character at a time and 20 random splits, and
    by ``_accumulated`` for 180 more (seeded by the text)."""
    rng = random.Random(text)
    for k, pieces in enumerate([[text], list(text), *(_splits(text, rng) for _ in range(200))]):
        if k < 22:
            message = _streamed(reader(), pieces)
            got = (message.content or None, [(c.function.name, c.function.arguments) for c in message.tool_calls or []])
        else:
            r = reader()
            got = _accumulated([d for piece in pieces for d in r.feed(piece)] + r.finish())
        assert got == (content, calls), pieces


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_streamed_deltas_add_up_to_the_message(parser, text, content, calls):
    message_content, message_calls = ChoiceToolCalls("auto", parser=parser).message(text)
    assert message_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message_calls] == calls
    _check_streams(lambda: ChoiceToolCalls("auto", parser=parser), text, content, calls)


_NOISE = [*'{}[]",:; \n\\u0d<>/|.eE-+tn', "<tool_call>", "</tool_call>", '"name"', '"arguments"', '"parameters"',
          "\\ud83d", "\\ude00", "<|python_tag|>"]


def _mutated(text: str, rng: random.Random) -> str:
    """``text`` with a few characters or fragments of the formats deleted or inserted, or cut."""
    chars = list(text)
    for _ in range(rng.randint(1, 4)):
        i, op = rng.randrange(len(chars) + 1), rng.random()
        if op < 0.4 and chars:
            del chars[min(i, len(chars) - 1)]
        elif op < 0.85:
            chars.insert(i, rng.choice(_NOISE))
        else:
            chars = chars[:i]
    return "".join(chars)


def test_any_output_streams_as_it_reads_whole():
    """Outputs near the formats (the cases, mutated; seeded): a character at a time and split at
    random, the stream adds up to the whole text's message, which UTF-8 can carry."""
    rng = random.Random(0)
    for _ in range(400):
        parser, base, _, _ = rng.choice(CASES)
        if len(text := _mutated(base, rng)) < 2:
            continue
        reader = ChoiceToolCalls("auto", parser=parser)
        whole = _accumulated(reader.feed(text) + reader.finish())
        json.dumps(whole, ensure_ascii=False).encode()
        for pieces in [list(text), _splits(text, rng), _splits(text, rng)]:
            reader = ChoiceToolCalls("auto", parser=parser)
            assert _accumulated([d for piece in pieces for d in reader.feed(piece)] + reader.finish()) == whole, pieces


def _loose_json(value, rng: random.Random) -> str:
    """JSON text of ``value`` as a model may write it: random whitespace, escapes, exponents."""
    space = lambda: rng.choice(["", "", " ", "\n", "\t "])  # noqa: E731
    if isinstance(value, dict):
        members = [f"{_loose_json(k, rng)}{space()}:{space()}{_loose_json(v, rng)}" for k, v in value.items()]
        return "{" + space() + f",{space()}".join(members) + space() + "}"
    if isinstance(value, list):
        return "[" + space() + f",{space()}".join(_loose_json(v, rng) for v in value) + space() + "]"
    if isinstance(value, float) and rng.random() < 0.5:
        return f"{value:E}"
    return json.dumps(value, ensure_ascii=rng.random() < 0.5)


def _random_value(rng: random.Random, depth: int = 0):
    kind = rng.random()
    if depth > 3 or kind < 0.3:
        return rng.choice([0, -7, 3.25, 1e20, 2**70, True, False, None, "", 'a"b\\c\n\t/é😀\u2028\x7f'])
    if kind < 0.65:
        return {rng.choice(["a", "ç", '"q"', "x y"]) + str(i): _random_value(rng, depth + 1)
                for i in range(rng.randint(0, 3))}
    return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]


def test_arguments_are_json_dumps_of_what_the_model_wrote():
    """Random arguments objects, loosely written (seeded): the call carries exactly json.dumps of
    the object json reads, streamed at random splits or not."""
    rng = random.Random(0)
    for _ in range(300):
        written = _loose_json({f"k{i}": _random_value(rng) for i in range(rng.randint(0, 4))}, rng)
        expected = (None, [("f", dumped(written))])
        for parser, text in [("hermes", f'<tool_call>{{"name": "f", "arguments": {written}}}</tool_call>'),
                             ("llama3_json", f'{{"name": "f", "parameters": {written}}}')]:
            reader = ChoiceToolCalls("auto", parser=parser)
            assert _accumulated(reader.feed(text) + reader.finish()) == expected, text
            reader = ChoiceToolCalls("auto", parser=parser)
            assert _accumulated([d for piece in _splits(text, rng) for d in reader.feed(piece)]
                                + reader.finish()) == expected, text


def _arguments_after_each_character(reader: ChoiceToolCalls, text: str) -> list[str | None]:
    """The first call's arguments as streamed after each character of ``text`` (None: no call yet)."""
    arguments, out = None, []
    for c in text:
        for delta in reader.feed(c):
            for call in delta.get("tool_calls", []):
                if call["index"] == 0:
                    arguments = (arguments or "") + call["function"]["arguments"]
                    assert ("id" in call) == (arguments == call["function"]["arguments"])
        out.append(arguments)
    return out


@pytest.mark.parametrize("choice, parser, before", [("auto", "hermes", 'Hi <tool_call>\n{"name": "get_weather", '
                                                                       '"arguments": '),
                                                    ("auto", "llama3_json", '{"name": "get_weather", "parameters": '),
                                                    ("required", None, '[{"name": "get_weather", "parameters": '),
                                                    ("named", None, "")])
def test_arguments_stream_as_they_are_written(choice, parser, before):
    """The call starts (id, name) at its arguments' "{"; then, within strings, every character
    goes out as it comes; a number waits for the character after it."""
    arguments = '{"city": "Paris", "unit": "celsius", "days": 12}'
    after = {"hermes": "}\n</tool_call>", "llama3_json": "}", None: "}]" if choice == "required" else ""}[parser]
    got = _arguments_after_each_character(ChoiceToolCalls(choice, parser=parser, function="get_weather"),
                                          before + arguments + after)
    assert got[:len(before)] == [None] * len(before)
    held = len('{"city": "Paris", "unit": "celsius", "days": ')
    for k in range(len(arguments) - 1):  # json's ": " and ", " go out with the ":" and ","
        expected = arguments[:k + 1] + " " * (arguments[k] in ":,") if k < held else arguments[:held]
        assert got[len(before) + k] == expected, k
    assert got[-1] == arguments


def test_text_is_held_only_while_it_may_become_a_call():
    reader = ChoiceToolCalls("auto", parser="hermes")
    assert reader.feed("x <tool_") == [{"content": "x"}]  # " <tool_" may start a call
    assert reader.feed('call>{"name": "Bob", ') == []  # may still be a head
    assert reader.feed('"age": 3}') == []  # not a head: held to </tool_call>
    assert reader.feed("</tool_call> y") == [{"content": ' <tool_call>{"name": "Bob", "age": 3}</tool_call>'},
                                             {"content": " y"}]
    reader = ChoiceToolCalls("auto", parser="llama3_json")
    assert reader.feed(' {"name": "get_') == []
    assert reader.feed('weather", "parameters": {"city"')[0]["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": '{"city"'}


def test_parallel_tool_calls_false_keeps_the_first_call():
    reader = partial(ChoiceToolCalls, "auto", parser="hermes", parallel=False)
    content, calls = reader().message(CASES[1][1])
    assert content == "Let me look." and [c["function"]["name"] for c in calls] == ["get_weather"]
    _check_streams(reader, CASES[1][1], "Let me look.", [("get_weather", dumped(WEATHER))])


# (tool_choice, constrained output, expected content, expected [(name, arguments text)]); the named
# function is get_weather.
CONSTRAINED = [
    ("required", '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]',
     None, [("get_weather", dumped({"city": "Paris"})), ("get_time", "{}")]),
    ("required", ' [ {"name":"get_weather" , "parameters":{"city":"Paris","days":3} } ]\n', None,
     [("get_weather", dumped({"city": "Paris", "days": 3}))]),
    ("required", '[{"name": "get_weather", "parameters": {"city": "Par', None,  # cut: as far as they went
     [("get_weather", '{"city": "Par')]),
    ("required", '[{"name": "get_we', '[{"name": "get_we', []),  # cut before a whole head: content
    ("named", '{"city":"Paris","days":3.0}', None, [("get_weather", dumped({"city": "Paris", "days": 3.0}))]),
    ("named", '{"city": "Par', None, [("get_weather", '{"city": "Par')]),
]


@pytest.mark.parametrize("choice, text, content, calls", CONSTRAINED)
def test_constrained_calls_stream_and_add_up(choice, text, content, calls):
    reader = partial(ChoiceToolCalls, choice, function="get_weather")
    message_content, message_calls = reader().message(text)
    assert (message_content, [(c["function"]["name"], c["function"]["arguments"]) for c in message_calls]) == (
        content, calls)
    _check_streams(reader, text, content, calls)


def test_required_schema():
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
