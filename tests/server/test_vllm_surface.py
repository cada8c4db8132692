"""vLLM's HTTP surface beyond OpenAI's, on the shared server: unknown fields ignored, echo,
best_of, truncate_prompt_tokens, /tokenize, /detokenize, /version, /v1/embeddings, X-Request-Id,
CORS, continue_final_message, and the ``vllm:`` series on /metrics checked against what the
test sent."""

from __future__ import annotations

import json
import time

import pytest
from helpers_server import MODEL
from prometheus_client.parser import text_string_to_metric_families

import pipeserve

pytestmark = pytest.mark.timeout(300)

COMP, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPT = "The capital of France is"


def tokenize(server, body: dict) -> dict:
    status, r = server.post("/tokenize", body)
    assert status == 200, r
    return r


def test_unknown_fields_are_ignored_and_logged_once(server):
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "vllm_bench_extra": 1}
    answers = [server.post(COMP, body) for _ in range(2)]
    assert [status for status, _ in answers] == [200, 200]
    assert answers[0][1]["choices"][0]["text"] == answers[1][1]["choices"][0]["text"]
    deadline = time.monotonic() + 10
    while True:  # the warning goes to the server's stderr
        with open(f"{server.run_dir}/stderr.txt") as f:
            lines = [x for x in f if "vllm_bench_extra" in x]
        if lines or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(lines) == 1 and "were present in the request but ignored" in lines[0]


def test_echo_prepends_the_prompt(server):
    base = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    _, plain = server.post(COMP, base)
    _, echoed = server.post(COMP, base | {"echo": True, "best_of": 1})
    assert echoed["choices"][0]["text"] == PROMPT + plain["choices"][0]["text"]
    ids = tokenize(server, {"prompt": PROMPT})["tokens"]
    _, by_ids = server.post(COMP, base | {"prompt": ids, "echo": True})
    assert by_ids["choices"][0]["text"] == PROMPT + plain["choices"][0]["text"]
    streamed = "".join(e["choices"][0]["text"] for e in server.stream(COMP, base | {"echo": True, "stream": True})
                       if e != "[DONE]")
    assert streamed == PROMPT + plain["choices"][0]["text"]


def test_truncate_prompt_tokens_keeps_the_last_k(server):
    text = "One two three four five six seven eight nine ten. " + PROMPT
    ids = tokenize(server, {"prompt": text})["tokens"]
    k = 6
    _, truncated = server.post(COMP, {"prompt": text, "max_tokens": 4, "temperature": 0, "truncate_prompt_tokens": k})
    _, reference = server.post(COMP, {"prompt": ids[-k:], "max_tokens": 4, "temperature": 0})
    assert truncated["usage"]["prompt_tokens"] == k
    assert truncated["choices"][0]["text"] == reference["choices"][0]["text"]
    _, chat = server.post(CHAT, {"messages": [{"role": "user", "content": text}], "max_tokens": 1,
                                 "truncate_prompt_tokens": k})
    assert chat["usage"]["prompt_tokens"] == k
    assert chat["usage"]["prompt_tokens_details"] is None  # no prefix caching on this server


def test_tokenize_and_detokenize(server):
    r = tokenize(server, {"model": MODEL, "prompt": PROMPT, "return_token_strs": True})
    _, _, models = server.request("GET", "/v1/models")
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == json.loads(models)["data"][0]["max_model_len"]
    assert "".join(r["token_strs"]) == PROMPT
    _, completion = server.post(COMP, {"prompt": PROMPT, "max_tokens": 1})
    assert completion["usage"]["prompt_tokens"] == r["count"]
    assert server.post("/detokenize", {"tokens": r["tokens"]}) == (200, {"prompt": PROMPT})

    messages = [{"role": "user", "content": "Hi"}]
    chat = tokenize(server, {"messages": messages})
    _, answer = server.post(CHAT, {"messages": messages, "max_tokens": 1})
    assert chat["count"] == answer["usage"]["prompt_tokens"]
    _, text = server.post("/detokenize", {"tokens": chat["tokens"]})
    assert text["prompt"].endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenize(server, {"messages": messages, "add_generation_prompt": False})["count"] < chat["count"]


def test_continue_final_message_continues_it(server):
    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": PROMPT}]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    ids = tokenize(server, body)["tokens"]
    _, text = server.post("/detokenize", {"tokens": ids})
    assert text["prompt"].endswith("<|im_start|>assistant\n" + PROMPT)  # no end of turn after it
    status, r = server.post(CHAT, body | {"max_tokens": 3, "temperature": 0})
    assert status == 200 and r["usage"]["prompt_tokens"] == len(ids)
    assert "Paris" in r["choices"][0]["message"]["content"]


def test_skip_special_tokens_over_http(server):
    """The finished answer's next token is the end of turn (<|im_end|>, EOS: kept going with
    ignore_eos); its text shows only with skip_special_tokens false."""
    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "The capital of France is Paris."}]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True, "max_tokens": 2,
            "temperature": 0, "ignore_eos": True, "spaces_between_special_tokens": False}
    _, kept = server.post(CHAT, body | {"skip_special_tokens": False})
    _, skipped = server.post(CHAT, body)
    kept, skipped = kept["choices"][0]["message"]["content"], skipped["choices"][0]["message"]["content"]
    assert kept.startswith("<|im_end|>") and "<|im_end|>" not in skipped
    assert kept.replace("<|im_end|>", "") == skipped


def test_version_and_embeddings(server):
    status, _, data = server.request("GET", "/version")
    assert status == 200 and json.loads(data) == {"version": pipeserve.__version__}
    status, r = server.post("/v1/embeddings", {"model": MODEL, "input": "hello"})
    assert status == 404 and "no embedding model" in r["error"]["message"]


def test_x_request_id_is_honoured_and_returned(server):
    status, headers, data = server.request("POST", COMP, json.dumps({"prompt": "Hi", "max_tokens": 1}).encode(),
                                           headers=server.headers({"X-Request-Id": "my-id-42"}))
    assert status == 200 and json.loads(data)["id"] == "cmpl-my-id-42"
    assert {k.lower(): v for k, v in headers.items()}["x-request-id"] == "my-id-42"
    status, headers, data = server.request("POST", CHAT, json.dumps({"messages": [{"role": "user", "content": "Hi"}],
                                                                    "max_tokens": 1}).encode())
    rid = {k.lower(): v for k, v in headers.items()}["x-request-id"]
    assert status == 200 and len(rid) == 32 and json.loads(data)["id"] == f"chatcmpl-{rid}"
    status, headers, _ = server.request("GET", "/v1/nothing", headers=server.headers({"X-Request-Id": "e1"}))
    assert status == 404 and {k.lower(): v for k, v in headers.items()}["x-request-id"] == "e1"


def test_cors_default_lets_no_web_page_in(server):
    """No origin is allowed by default (vLLM allows any): a page's preflight gets no CORS
    headers, so the browser never sends the request, and answers carry none either."""
    preflight = {"Origin": "https://example.com", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type,authorization"}
    status, headers, _ = server.request("OPTIONS", COMP, headers=preflight)
    assert status == 400 and "access-control-allow-origin" not in {k.lower() for k in headers}
    status, headers, _ = server.request("GET", "/v1/models", headers=server.headers({"Origin": "https://x.org"}))
    assert status == 200 and "access-control-allow-origin" not in {k.lower() for k in headers}


def scrape(server) -> dict[tuple, float]:
    """Every sample of /metrics: (name, labels other than model_name) -> value; model_name must
    be the served model's on every ``vllm:`` sample."""
    _, _, data = server.request("GET", "/metrics")
    out = {}
    for family in text_string_to_metric_families(data.decode()):
        for s in family.samples:
            labels = dict(s.labels)
            if s.name.startswith("vllm:"):
                assert labels.pop("model_name") == MODEL, s
            out[(s.name, tuple(sorted(labels.items())))] = s.value
    return out


def grew(after: dict, before: dict, name: str, labels: tuple = ()) -> float:
    return after.get((name, labels), 0) - before.get((name, labels), 0)


def settled_scrape(server, name: str = "vllm:prefix_cache_queries_total") -> dict:
    """A scrape once the server is idle and the engine's counter ``name`` has stopped moving
    (the engine's figures arrive with its stats messages, every 0.5 s and when it goes idle: an
    earlier test's last ones may still be on their way)."""
    server.wait_idle(timeout_s=60)
    last, deadline = scrape(server), time.monotonic() + 30
    while True:
        time.sleep(1.0)
        now = scrape(server)
        if now.get((name, ())) == last.get((name, ())) or time.monotonic() > deadline:
            return now
        last = now


def test_vllm_metrics_count_what_was_sent(server):
    before = settled_scrape(server)
    prompts = ["Hello there", "Name a planet.", "What do bees make? Answer in one word."]
    usages = []
    for p in prompts:
        status, r = server.post(COMP, {"prompt": p, "max_tokens": 3, "temperature": 0, "ignore_eos": True})
        assert status == 200
        usages.append(r["usage"])
    num_prompt = sum(u["prompt_tokens"] for u in usages)
    deadline = time.monotonic() + 30
    while True:  # the engine's own figures arrive with its next stats message
        after = scrape(server)
        if grew(after, before, "vllm:prefix_cache_queries_total") >= num_prompt or time.monotonic() > deadline:
            break
        time.sleep(0.1)

    def grew_by(name, labels=()):
        return grew(after, before, name, labels)

    assert grew_by("vllm:request_success_total", (("finished_reason", "length"),)) == len(prompts)
    assert grew_by("vllm:prompt_tokens_total") == num_prompt
    assert grew_by("vllm:generation_tokens_total") == 3 * len(prompts)
    assert grew_by("vllm:request_prompt_tokens_count") == len(prompts)
    assert grew_by("vllm:request_prompt_tokens_sum") == num_prompt
    assert grew_by("vllm:request_generation_tokens_sum") == 3 * len(prompts)
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds"):
        assert grew_by(f"{name}_count") == len(prompts)
        assert grew_by(f"{name}_sum") > 0
    for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
        assert grew_by(f"{name}_count") == 2 * len(prompts)  # 3 tokens: 2 gaps each
    assert ("vllm:time_to_first_token_seconds_bucket", (("le", "0.001"),)) in after  # vLLM's buckets
    assert ("vllm:request_prompt_tokens_bucket", (("le", "500.0"),)) in after  # 1-2-5 up to max_model_len
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                  "vllm:gpu_cache_usage_perc"):
        assert (gauge, ()) in after
    for counter in ("vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
        assert (counter, ()) in after
    assert grew_by("vllm:prefix_cache_queries_total") == num_prompt  # caching off: queried, never hit
    assert grew_by("vllm:prefix_cache_hits_total") == 0
