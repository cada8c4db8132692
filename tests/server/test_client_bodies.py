"""The exact request bodies that common load clients send, answered 200 with a well-formed stream.

Each body is written here field for field as the client builds it (values filled in for this
server), from the client's source at the commit named:

- ``vllm bench serve``: vllm-project/vllm, ``vllm/benchmarks/lib/endpoint_request_func.py`` at
  3aee4a4f4c4d1a2a7af3ebdb88c768e459e6c602 (``async_request_openai_completions``,
  ``async_request_openai_chat_completions``; ``_update_payload_common`` adds ``ignore_eos``
  with ``--ignore-eos``). It sends ``repetition_penalty`` on every completion, ``logprobs: null``,
  ``stream_options``, ``max_completion_tokens``, and chat content as a list of parts.
- SGLang's ``bench_serving``: sgl-project/sglang, ``python/sglang/bench_serving.py`` at
  0033168f0f58b2bc05aa0273bd475d9c01bafb1c (``async_request_openai_chat_completions``, and the
  completions body of its OpenAI-compatible backends: ``best_of: 1``, ``ignore_eos``).
- vLLM's older ``benchmarks/benchmark_serving.py`` client, still copied into many research
  repositories: vllm-project/vllm, ``benchmarks/backend_request_func.py`` at
  011841309828ee36ff4c125eb2390b56e1c1bbad (``best_of``, ``logprobs: null``).
"""

from __future__ import annotations

import pytest
from helpers_server import MODEL

pytestmark = pytest.mark.timeout(300)

PROMPT = "The capital of France is"
MAX_TOKENS = 4

BODIES = {
    "vllm-bench-serve-completions": ("/v1/completions", {
        "model": MODEL, "prompt": PROMPT, "repetition_penalty": 1.0, "max_tokens": MAX_TOKENS,
        "logprobs": None, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
    }),
    "vllm-bench-serve-chat": ("/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
        "max_completion_tokens": MAX_TOKENS, "stream": True, "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }),
    "sglang-bench-serving-completions": ("/v1/completions", {
        "model": MODEL, "prompt": PROMPT, "temperature": 0.0, "best_of": 1, "max_tokens": MAX_TOKENS,
        "stream": True, "ignore_eos": True,
    }),
    "sglang-bench-serving-chat": ("/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "temperature": 0.0,
        "max_tokens": MAX_TOKENS, "stream": True,
    }),
    "vllm-benchmark-serving-legacy-completions": ("/v1/completions", {
        "model": MODEL, "prompt": PROMPT, "temperature": 0.0, "best_of": 1, "max_tokens": MAX_TOKENS,
        "logprobs": None, "stream": True,
    }),
}


@pytest.mark.parametrize("client", sorted(BODIES))
def test_client_body_is_served(server, client):
    path, body = BODIES[client]
    events = list(server.stream(path, body))  # (asserts the 200)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e.get("choices")]
    chat = path.endswith("chat/completions")
    text = "".join((c["choices"][0]["delta"].get("content") or "") if chat else c["choices"][0]["text"]
                   for c in chunks)
    assert text.strip(), events
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    usage = [e["usage"] for e in events[:-1] if e.get("usage")]
    if body.get("stream_options", {}).get("include_usage"):
        assert usage and usage[-1]["completion_tokens"] <= MAX_TOKENS and usage[-1]["prompt_tokens"] > 0
    if body.get("ignore_eos"):
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
