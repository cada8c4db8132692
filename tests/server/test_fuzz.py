"""The server's /openapi.json, and Schemathesis driven by it against the live server: every
generated request (valid and invalid bodies, wrong types, missing fields, unknown methods) gets
a status the document declares and never a 5xx, and the server is idle afterwards.

CI runs a few examples per operation; `-m slow` a larger run. `python benchmarks/reliability.py
--only bad` runs Schemathesis's CLI (its coverage phase too) and records the statuses."""

from __future__ import annotations

import json

import pytest
import schemathesis
from helpers_bad_requests import GENERATING, cap_generation, checks, load_schema
from hypothesis import HealthCheck, settings

pytestmark = pytest.mark.timeout(600)

schema = schemathesis.pytest.from_fixture("openapi_schema")


@pytest.fixture
def openapi_schema(server):
    return load_schema(server)


@pytest.fixture(scope="module")
def max_model_len(server) -> int:
    status, _, data = server.request("GET", "/v1/models")
    return json.loads(data)["data"][0]["max_model_len"]


def test_the_document_names_every_route_and_request_model(server):
    status, _, _ = server.request("GET", "/openapi.json", headers={})
    assert status == 401  # with a key, the document too needs it
    status, _, data = server.request("GET", "/openapi.json")
    assert status == 200
    doc = json.loads(data)
    assert set(doc["paths"]) == {"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions",
                                 "/v1/requests/{response_id}/cancel", "/tokenize", "/detokenize", "/version",
                                 "/v1/embeddings"}
    models = doc["components"]["schemas"]
    for name, path in (("CompletionRequest", "/v1/completions"), ("ChatCompletionRequest", "/v1/chat/completions")):
        op = doc["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{name}"}
        assert {"400", "401", "413", "415", "429", "503"} <= set(op["responses"])
        assert models[name]["additionalProperties"] is True  # unknown fields are ignored (vLLM's leniency)
    assert models["CompletionRequest"]["required"] == ["prompt"]
    assert "ChatMessage" in models and "ErrorResponse" in models
    tokenize = doc["paths"]["/tokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert tokenize == {"anyOf": [{"$ref": "#/components/schemas/TokenizeCompletionRequest"},
                                  {"$ref": "#/components/schemas/TokenizeChatRequest"}]}
    status, _, _ = server.request("GET", "/openapi.json", headers={"Host": "rebound.example"})
    assert status == 400  # the Host guard stands in front of it as of every route


def fuzz(case, server, max_model_len: int) -> None:
    if case.operation.label in GENERATING:
        case.body = cap_generation(case.body, max_model_len)
    case.call_and_validate(headers={"Authorization": f"Bearer {server.api_key}"}, checks=checks(), timeout=120)


@schema.parametrize()
@settings(max_examples=4, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
def test_schemathesis_a_few_cases_per_operation(case, server, max_model_len):
    fuzz(case, server, max_model_len)


@pytest.mark.slow
@schema.parametrize()
@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_schemathesis_many_cases_per_operation(case, server, max_model_len):
    fuzz(case, server, max_model_len)


def test_idle_after_the_fuzzer(server):
    status, r = server.post("/v1/completions", {"prompt": "The sky is", "max_tokens": 2, "temperature": 0})
    assert status == 200
    assert server.wait_idle(timeout_s=60)["pipeserve:kv_cache_blocks_used"] == 0
