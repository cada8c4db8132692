"""Structured outputs over HTTP with the official `openai` client: OpenAI's response_format and
vLLM's guided_* extras, streamed and not; a schema that does not compile is a 400."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from helpers_server import API_KEY, MODEL

pytestmark = pytest.mark.timeout(600)

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


def test_response_format_json_schema(client):
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, temperature=0.7, seed=1, max_tokens=80,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    assert r.choices[0].finish_reason == "stop"


def test_response_format_json_object_streamed(client):
    ask = [{"role": "user", "content": 'Reply with exactly this JSON object: {"ok": true}'}]
    chunks = client.chat.completions.create(model=MODEL, messages=ask, temperature=0, max_tokens=60, stream=True,
                                            response_format={"type": "json_object"})
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(json.loads(text), dict)


def test_guided_choice_and_regex(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Capital of France?"}],
                                       temperature=0, max_tokens=10,
                                       extra_body={"guided_choice": ["Paris", "Lyon", "Nice"]})
    assert r.choices[0].message.content in ("Paris", "Lyon", "Nice")
    r = client.completions.create(model=MODEL, prompt="A phone number: ", temperature=1.0, seed=3, max_tokens=20,
                                  extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", r.choices[0].text)


def test_bad_constraints_are_400(client):
    with pytest.raises(openai.BadRequestError, match="parenthesis"):
        client.completions.create(model=MODEL, prompt="x", extra_body={"guided_regex": "a(b"})
    with pytest.raises(openai.BadRequestError, match="json"):
        client.chat.completions.create(model=MODEL, messages=ASK, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}})
    with pytest.raises(openai.BadRequestError, match="one structured-output constraint"):
        client.completions.create(model=MODEL, prompt="x", extra_body={"guided_regex": "a", "guided_choice": ["b"]})
