"""Tool calling over HTTP with the `openai` client, on one server of its own: the embedded
SmolLM2 with a Hermes-style chat template written here, ``server.tool_call_parser=hermes`` and
``server.enable_auto_tool_choice``. tool_choice "required" and a named function constrain the
output, so even a 135M model answers valid calls; "auto" is checked against the parser on the
same greedy output rendered with tool_choice "none", and on a Hermes call that a regex makes the
model write. Streamed, a call's arguments come over several deltas, which the client adds up to
the non-streamed call."""

from __future__ import annotations

import asyncio
import json

import jinja2
import jsonschema
import openai
import pytest
from helpers_server import API_KEY, MODEL, Server

from pipeserve.runtime.serving.api_server import OpenAIServing, ServerConfig
from pipeserve.runtime.serving.openai_protocol import ApiError, ChatCompletionRequest, parse
from pipeserve.runtime.serving.tool_calls import parse_tool_calls

pytestmark = pytest.mark.timeout(600)

TEMPLATE = """{% if tools %}<|im_start|>system
You can call these functions:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Answer a call as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>
{% endif %}{% for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{% for c in m.tool_calls %}<tool_call>{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}</tool_call>
{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London"]},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                   "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_CALL = (r'Let me check\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|London)", '
               r'"unit": "(celsius|fahrenheit)"\}\}\n</tool_call>')


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tools")
    (tmp / "template.jinja").write_text(TEMPLATE)
    s = Server.start(tmp, "engine.num_kv_blocks=64", f"server.chat_template={tmp / 'template.jinja'}",
                     "server.tool_call_parser=hermes", "server.enable_auto_tool_choice=true")
    try:
        yield s
    finally:
        s.kill()


def _client(server, cls=openai.OpenAI):
    return cls(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _calls(message) -> list[tuple[str, dict]]:
    """(name, arguments) of a message's calls, each checked against its function's schema."""
    out = []
    for call in message.tool_calls or []:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    return out


def test_named_function_sync_stream_and_not(tool_server):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=40,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    with _client(tool_server) as c:
        whole = c.chat.completions.create(**kw)
        with c.chat.completions.stream(**kw) as stream:
            streamed = stream.get_final_completion()
    for r in (whole, streamed):
        assert r.choices[0].finish_reason == "tool_calls"
        assert [name for name, _ in _calls(r.choices[0].message)] == ["get_weather"]
    assert _calls(streamed.choices[0].message) == _calls(whole.choices[0].message)


def _arguments(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def test_required_async_stream_and_not(tool_server):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=60, tool_choice="required")

    async def both():
        async with _client(tool_server, openai.AsyncOpenAI) as c:
            whole = await c.chat.completions.create(**kw)
            async with c.chat.completions.stream(**kw) as stream:
                fragments = [e.arguments_delta async for e in stream if e.type == "tool_calls.function.arguments.delta"]
                streamed = await stream.get_final_completion()
        return whole, streamed, fragments

    whole, streamed, fragments = asyncio.run(both())
    assert whole.choices[0].finish_reason == streamed.choices[0].finish_reason == "tool_calls"
    assert whole.choices[0].message.content is None
    assert len(_calls(whole.choices[0].message)) >= 1
    assert _arguments(streamed.choices[0].message) == _arguments(whole.choices[0].message)
    assert len([f for f in fragments if f]) > len(whole.choices[0].message.tool_calls)  # arguments over several deltas


def test_auto_streams_a_call_as_the_model_writes_it(tool_server):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=80,
              extra_body={"guided_regex": HERMES_CALL})
    with _client(tool_server) as c:
        whole = c.chat.completions.create(**kw)
        with c.chat.completions.stream(**kw) as stream:
            events = list(stream)
            streamed = stream.get_final_completion()
    for r in (whole, streamed):
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content == "Let me check."
    assert [name for name, _ in _calls(whole.choices[0].message)] == ["get_weather"]
    assert _arguments(streamed.choices[0].message) == _arguments(whole.choices[0].message)
    calls = [e.chunk.choices[0].delta.tool_calls[0] for e in events
             if e.type == "chunk" and e.chunk.choices and e.chunk.choices[0].delta.tool_calls]
    assert calls[0].id and calls[0].function.name == "get_weather"  # the first delta: id and name
    assert all(c.id is None and c.function.name is None for c in calls[1:]) and len(calls) > 2
    assert "".join(c.function.arguments for c in calls) == whole.choices[0].message.tool_calls[0].function.arguments


def test_auto_reads_the_output_with_the_parser(tool_server):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=24)
    with _client(tool_server) as c:
        raw = c.chat.completions.create(**kw, tool_choice="none").choices[0]
        auto = c.chat.completions.create(**kw).choices[0]  # "auto": the default with tools
    content, calls = parse_tool_calls("hermes", raw.message.content)
    assert auto.message.content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in auto.message.tool_calls or []]
    if not calls:  # what SmolLM2 answers here: plain text, no call
        assert auto.message.tool_calls is None and auto.finish_reason == raw.finish_reason


def test_a_tool_round_trip_renders_the_call_and_its_result(tool_server):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}]
    status, r = tool_server.post("/tokenize", {"messages": messages, "tools": TOOLS})
    assert status == 200, r
    _, text = tool_server.post("/detokenize", {"tokens": r["tokens"]})
    # The reference: the template rendered by plain Jinja, the arguments given as an object.
    rendered = [dict(m, content=m["content"] or "") for m in messages]
    rendered[1]["tool_calls"] = [dict(call, function={"name": "get_weather",
                                                      "arguments": {"city": "Paris", "unit": "celsius"}})]
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = json.dumps
    assert text["prompt"] == env.from_string(TEMPLATE).render(messages=rendered, tools=TOOLS,
                                                              add_generation_prompt=True)
    assert ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>'
            in text["prompt"]) and "<tool_response>18 degrees and sunny</tool_response>" in text["prompt"]
    with _client(tool_server) as c:
        answer = c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                           temperature=0, max_tokens=8)
    assert answer.usage.prompt_tokens == r["count"] and answer.choices[0].message.content


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_stock"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"$ref": "#/$defs/missing"}}}}}], "tool_choice": "none"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "an object"}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a+"}, "guided_regex"),
])
def test_bad_tool_requests_are_400(tool_server, body, param):
    status, r = tool_server.post("/v1/chat/completions", {"messages": ASK, "max_tokens": 4, **body})
    assert status == 400 and r["error"]["type"] == "invalid_request_error" and r["error"]["param"] == param, r


def test_auto_needs_the_server_option():
    serving = OpenAIServing(ServerConfig(tool_call_parser="hermes"), None, None, {}, MODEL, None)
    for choice in ("", ', "tool_choice": "auto"'):
        req = parse(ChatCompletionRequest, f'{{"messages": {json.dumps(ASK)}, "tools": [{{"type": "function", '
                                           f'"function": {{"name": "f"}}}}]{choice}}}'.encode())
        with pytest.raises(ApiError) as e:
            serving.tool_calls(req)
        assert e.value.status == 400 and e.value.param == "tool_choice"
    with pytest.raises(ValueError, match="tool_call_parser"):
        ServerConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="tool_call_parser"):
        ServerConfig(tool_call_parser="mistral")
