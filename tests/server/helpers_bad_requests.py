"""Bad requests for a live server: a hand-made table (``BAD``) and Schemathesis driven by the
server's /openapi.json. Shared by test_bad_requests.py, test_fuzz.py and
benchmarks/reliability.py, which records what each gets.

Schemathesis's generated bodies are sent as generated but for one change: a body that would make
many tokens (``max_tokens`` absent, null, or anything up to the context; ``n`` up to the
server's limit) is capped at a few tokens and sequences, so a case costs milliseconds of
validation rather than seconds of decoding on a small CPU. Out-of-range values (0, negative,
past the context or the limit, 2**70) are left alone: those are what the fuzzer is for.
"""

from __future__ import annotations

import json
import socket
from collections import Counter
from dataclasses import dataclass

from helpers_server import API_KEY

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "Hi"}]
LONG_PROMPT = "hello " * 600  # > max_model_len (512) tokens


def js(body) -> bytes:
    return json.dumps(body).encode()


def raw_post(path: str, body: bytes, *head: str, content_length: int | None = None) -> bytes:
    """A whole POST with the key and ``head`` lines (Content-Type is one of them, if any)."""
    length = len(body) if content_length is None else content_length
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", f"Authorization: Bearer {API_KEY}", *head,
             f"Content-Length: {length}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


JSON = "Content-Type: application/json"


@dataclass(frozen=True, slots=True)
class Bad:
    """One bad request and what it must get."""

    name: str
    status: int | None
    """The status it must get; None: the connection is closed without an answer."""
    word: str = ""
    """A word the error body's message must contain; "" where the answer is uvicorn's own, not
    an OpenAI error body."""
    path: str = COMP
    body: bytes | None = None
    method: str = "POST"
    headers: dict | None = None
    """Sent instead of the default (JSON content type and the API key)."""
    raw: bytes | None = None
    """The whole request, sent on a bare socket (what http.client would not send)."""


BAD = [
    # The body: not JSON, not an object, not UTF-8.
    Bad("invalid-json", 400, "JSON", CHAT, b'{"messages": ['),
    Bad("not-an-object", 400, "object", CHAT, b"[1, 2, 3]"),
    Bad("empty-body", 400, "JSON", COMP, b""),
    Bad("non-utf8", 400, "JSON", COMP, b'{"prompt": "\xff\xfe bad"}'),
    Bad("overlong-utf8-sequence", 400, "JSON", COMP, b'{"prompt": "a\xc3\x28"}'),
    Bad("utf16-body", 400, "JSON", COMP, '{"prompt": "a"}'.encode("utf-16")),
    Bad("utf8-bom", 400, "JSON", COMP, b'\xef\xbb\xbf{"prompt": "a"}'),
    Bad("lone-surrogate-escape", 400, "JSON", COMP, b'{"prompt": "a", "stop": ["\\ud800"]}'),
    Bad("nan-literal", 400, "temperature", COMP, b'{"prompt": "a", "temperature": NaN}'),
    Bad("infinity-literal", 400, "top_p", COMP, b'{"prompt": "a", "top_p": Infinity}'),
    Bad("float-overflow-1e400", 400, "temperature", COMP, b'{"prompt": "a", "temperature": 1e400}'),
    Bad("5000-digit-integer", 400, "JSON", COMP, b'{"prompt": "a", "max_tokens": 1' + b"0" * 5000 + b"}"),
    Bad("nested-100k-deep", 400, "JSON", COMP, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    Bad("oversized-body", 413, "larger", COMP, js({"prompt": "x" * (5 * 2**20)})),
    # Fields: missing, wrong types (unknown ones are ignored, as vLLM does).
    Bad("missing-messages", 400, "messages", CHAT, js({"max_tokens": 2})),
    Bad("missing-prompt", 400, "prompt", COMP, js({"max_tokens": 2})),
    Bad("messages-wrong-type", 400, "messages", CHAT, js({"messages": "hi"})),
    Bad("max-tokens-string", 400, "max_tokens", COMP, js({"prompt": "a", "max_tokens": "ten"})),
    Bad("max-tokens-float", 400, "max_tokens", COMP, js({"prompt": "a", "max_tokens": 2.0})),
    Bad("max-tokens-bool", 400, "max_tokens", COMP, js({"prompt": "a", "max_tokens": True})),
    Bad("temperature-string", 400, "temperature", COMP, js({"prompt": "a", "temperature": "hot"})),
    Bad("bad-role", 400, "role", CHAT, js({"messages": [{"role": "wizard", "content": "x"}]})),
    Bad("known-field-beside-unknown-one", 400, "max_tokens", CHAT,
        js({"messages": MSG, "frobnicate": True, "max_tokens": "2"})),
    Bad("best-of-above-n", 400, "best_of", COMP, js({"prompt": "a", "best_of": 3})),
    Bad("prompt-logprobs-streamed", 400, "prompt_logprobs", COMP,
        js({"prompt": "a", "prompt_logprobs": 1, "stream": True})),
    Bad("truncate-prompt-tokens-zero", 400, "truncate_prompt_tokens", COMP,
        js({"prompt": "a", "truncate_prompt_tokens": 0})),
    Bad("continue-final-message-with-generation-prompt", 400, "continue_final_message", CHAT,
        js({"messages": MSG + [{"role": "assistant", "content": "Hello"}], "continue_final_message": True})),
    Bad("chat-template-kwargs-not-an-object", 400, "chat_template_kwargs", CHAT,
        js({"messages": MSG, "chat_template_kwargs": [1]})),
    Bad("detokenize-out-of-vocab", 400, "token ids", "/detokenize", js({"tokens": [1, 10**9]})),
    Bad("tokenize-prompt-wrong-type", 400, "prompt", "/tokenize", js({"prompt": 5})),
    Bad("tokenize-empty-messages", 400, "messages", "/tokenize", js({"messages": []})),
    Bad("embeddings", 404, "no embedding model", "/v1/embeddings", js({"input": "a"})),
    Bad("unknown-model", 404, "does not exist", CHAT, js({"model": "gpt-9", "messages": MSG})),
    Bad("presence-penalty-above-2", 400, "presence_penalty", CHAT, js({"messages": MSG, "presence_penalty": 2.5})),
    Bad("repetition-penalty-zero", 400, "repetition_penalty", COMP, js({"prompt": "a", "repetition_penalty": 0})),
    Bad("logit-bias-key-not-an-id", 400, "logit_bias", COMP, js({"prompt": "a", "logit_bias": {"abc": 1}})),
    Bad("logit-bias-above-100", 400, "logit_bias", COMP, js({"prompt": "a", "logit_bias": {"5": 101}})),
    Bad("logit-bias-past-vocab", 400, "logit_bias", COMP, js({"prompt": "a", "logit_bias": {"10000000": 1}})),
    Bad("allowed-token-ids-empty", 400, "allowed_token_ids", COMP, js({"prompt": "a", "allowed_token_ids": []})),
    Bad("allowed-token-ids-past-vocab", 400, "allowed_token_ids", COMP,
        js({"prompt": "a", "allowed_token_ids": [10000000]})),
    Bad("stream-options-without-stream", 400, "stream_options", CHAT,
        js({"messages": MSG, "stream_options": {"include_usage": True}})),
    # Values out of range.
    Bad("max-tokens-zero", 400, "max_tokens", COMP, js({"prompt": "a", "max_tokens": 0})),
    Bad("max-tokens-negative", 400, "max_tokens", CHAT, js({"messages": MSG, "max_tokens": -5})),
    Bad("max-tokens-above-context", 400, "max_model_len", COMP, js({"prompt": "a", "max_tokens": 100000})),
    Bad("negative-temperature", 400, "temperature", CHAT, js({"messages": MSG, "temperature": -0.5})),
    Bad("top-p-above-one", 400, "top_p", CHAT, js({"messages": MSG, "top_p": 1.5})),
    Bad("top-k-minus-2", 400, "top_k", COMP, js({"prompt": "a", "top_k": -2})),
    Bad("n-zero", 400, "n must", COMP, js({"prompt": "a", "n": 0})),
    Bad("n-too-many", 400, "sequences", COMP, js({"prompt": "a", "n": 1000})),
    Bad("65-prompts", 400, "sequences", COMP, js({"prompt": ["a"] * 65, "max_tokens": 1})),
    Bad("logprobs-too-many", 400, "logprobs", COMP, js({"prompt": "a", "logprobs": 100})),
    Bad("echo-logprobs-too-many", 400, "logprobs", COMP, js({"prompt": "a", "echo": True, "logprobs": 21})),
    Bad("prompt-logprobs-negative", 400, "prompt_logprobs", COMP, js({"prompt": "a", "prompt_logprobs": -1})),
    Bad("prompt-logprobs-too-many", 400, "prompt_logprobs", CHAT, js({"messages": MSG, "prompt_logprobs": 21})),
    Bad("top-logprobs-negative", 400, "logprobs", CHAT,
        js({"messages": MSG, "logprobs": True, "top_logprobs": -1})),
    Bad("enormous-stop-list", 400, "stop", COMP, js({"prompt": "a", "stop": [f"s{i}" for i in range(5000)]})),
    Bad("stop-token-negative", 400, "stop_token_ids", COMP, js({"prompt": "a", "stop_token_ids": [-1]})),
    Bad("token-id-out-of-vocab", 400, "token ids", COMP, js({"prompt": [1, 2, 10**9]})),
    Bad("token-id-negative", 400, "token ids", COMP, js({"prompt": [-1]})),
    # Prompts: empty, longer than the context.
    Bad("empty-prompt", 400, "empty", COMP, js({"prompt": "", "max_tokens": 2})),
    Bad("empty-prompt-list", 400, "empty", COMP, js({"prompt": [], "max_tokens": 2})),
    Bad("empty-prompt-in-batch", 400, "empty", COMP, js({"prompt": ["a", ""], "max_tokens": 2})),
    Bad("empty-token-list-in-batch", 400, "empty", COMP, js({"prompt": [[1], []], "max_tokens": 2})),
    Bad("prompt-too-long", 400, "max_model_len", COMP, js({"prompt": LONG_PROMPT, "max_tokens": 1})),
    Bad("chat-too-long", 400, "max_model_len", CHAT,
        js({"messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": 1})),
    Bad("empty-messages", 400, "messages", CHAT, js({"messages": []})),
]
# Integers beyond what the wire (64 bits) or the model (its vocabulary) holds: each a 400 naming
# the field, never a 500 that leaks an admission slot (n=2: no first sequence left running).
OVERSIZED = [
    Bad("seed-2^64", 400, "seed", COMP, js({"prompt": "a", "max_tokens": 2, "seed": 2**64})),
    Bad("seed-2^64-n2", 400, "seed", COMP, js({"prompt": "a", "max_tokens": 2, "n": 2, "seed": 2**64})),
    Bad("seed-minus-2^64", 400, "seed", COMP, js({"prompt": "a", "max_tokens": 2, "seed": -(2**64)})),
    Bad("top-k-2^70", 400, "top_k", CHAT, js({"messages": MSG, "max_tokens": 2, "top_k": 2**70})),
    Bad("top-k-above-vocab", 400, "top_k", CHAT, js({"messages": MSG, "max_tokens": 2, "top_k": 10**6})),
    Bad("stop-token-2^70", 400, "stop_token_ids", COMP,
        js({"prompt": "a", "max_tokens": 2, "stop_token_ids": [2**70]})),
    Bad("stop-token-above-vocab", 400, "stop_token_ids", COMP, js({"prompt": "a", "n": 2, "stop_token_ids": [10**6]})),
    Bad("min-tokens-2^65", 400, "min_tokens", COMP, js({"prompt": "a", "max_tokens": 2, "min_tokens": 2**65})),
    Bad("max-tokens-2^64", 400, "max_tokens", COMP, js({"prompt": "a", "max_tokens": 2**64})),
    Bad("max-completion-tokens-2^70", 400, "max_tokens", CHAT, js({"messages": MSG, "max_completion_tokens": 2**70})),
    Bad("n-2^64", 400, "sequences", COMP, js({"prompt": "a", "max_tokens": 2, "n": 2**64})),
    Bad("n-minus-2^70", 400, "n must", COMP, js({"prompt": "a", "max_tokens": 2, "n": -(2**70)})),
    Bad("logprobs-2^70", 400, "logprobs", COMP, js({"prompt": "a", "max_tokens": 2, "logprobs": 2**70})),
    Bad("token-id-2^70", 400, "token ids", COMP, js({"prompt": [2**70], "max_tokens": 2})),
]
# The HTTP edge: routes, methods, headers, framing.
EDGE = [
    Bad("unknown-route", 404, "not found", "/v1/nothing-here", method="GET"),
    Bad("get-on-post-route", 405, "not allowed", COMP, method="GET"),
    Bad("delete-models", 405, "not allowed", "/v1/models", method="DELETE"),
    Bad("options", 405, "not allowed", CHAT, method="OPTIONS"),
    Bad("docs-page-off", 404, "not found", "/docs", method="GET"),
    Bad("cancel-unknown-id", 404, "in flight", "/v1/requests/cmpl-nope/cancel", b"{}"),
    Bad("wrong-api-key", 401, "API key", "/v1/models", method="GET", headers={"Authorization": "Bearer nope"}),
    Bad("no-api-key", 401, "API key", "/openapi.json", method="GET", headers={}),
    Bad("foreign-host", 400, "Host", "/health", method="GET", headers={"Host": "rebound.example"}),
    Bad("text-plain-body", 415, "JSON", raw=raw_post(COMP, js({"prompt": "a"}), "Content-Type: text/plain")),
    Bad("no-content-type", 415, "JSON", raw=raw_post(COMP, js({"prompt": "a"}))),
    Bad("json-patch-content-type", 415, "JSON",
        raw=raw_post(COMP, js({"prompt": "a"}), "Content-Type: application/json-patch+json")),
    Bad("form-body", 415, "JSON", raw=raw_post(COMP, b"prompt=a", "Content-Type: application/x-www-form-urlencoded")),
    Bad("content-length-not-a-number", 400, raw=raw_post(COMP, b"{}", JSON).replace(b"Length: 2", b"Length: x")),
    Bad("content-length-2^70", 400, raw=raw_post(COMP, b"{}", JSON, content_length=2**70)),
    Bad("chunked-body-over-the-limit", 413, "larger",
        raw=raw_post(COMP, b"", JSON, "Transfer-Encoding: chunked").replace(b"Content-Length: 0\r\n", b"")
        + (b"100000\r\n" + b"x" * 0x100000 + b"\r\n") * 5 + b"0\r\n\r\n"),
    Bad("200-kB-header", None, raw=b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n"),
    Bad("not-http", 400, raw=b"\x00\x01\x02 hello\r\n\r\n"),
]
# A body that stops coming: 408 after server.body_timeout_s, not a slot held for good.
SLOW_BODY = Bad("body-stops-coming", 408, "did not arrive", raw=raw_post(COMP, b'{"prompt"', JSON, content_length=100))
ALL = BAD + OVERSIZED + EDGE + [SLOW_BODY]


def send(server, case: Bad, timeout_s: float = 60.0) -> tuple[int | None, bytes]:
    """(status, body) of ``case`` sent to ``server``; status None if the server closed the
    connection without answering."""
    if case.raw is None:
        headers = server.headers() if case.headers is None else case.headers
        status, _, data = server.request(case.method, case.path, case.body, headers=headers, timeout_s=timeout_s)
        return status, data
    with socket.create_connection((server.host, server.port), timeout=timeout_s) as sock:
        try:
            sock.sendall(case.raw)
            answer = _read_answer(sock)
        except ConnectionError:
            return None, b""
    if not answer:
        return None, b""
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def error_message(data: bytes) -> str | None:
    """The message of an OpenAI error body; None if ``data`` is not one."""
    try:
        err = json.loads(data)["error"]
    except (ValueError, KeyError, TypeError):
        return None
    return err["message"] if set(err) == {"message", "type", "param", "code"} else None


def _read_answer(sock: socket.socket) -> bytes:
    """One HTTP answer with a Content-Length (what the server sends for errors), or what
    arrives before the server closes the connection."""
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
        head, sep, body = data.partition(b"\r\n\r\n")
        if sep:
            lengths = [int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")]
            if lengths and len(body) >= lengths[0]:
                return data


# ---- Schemathesis ---------------------------------------------------------------------------

MAX_TOKENS_CAP = 4
N_CAP = 2
MAX_SEQUENCES = 64  # server.max_sequences_per_request's default
GENERATING = ("POST /v1/completions", "POST /v1/chat/completions")
# What a fuzzed answer must satisfy: no 5xx, a status, content type and headers the document
# declares, and a schema-invalid body refused with a 4xx. Not `positive_data_acceptance`: the
# document gives types, not the ranges that depend on the model (its context, its vocabulary),
# so a schema-valid body may rightly get a 400.
CHECK_NAMES = ["not_a_server_error", "status_code_conformance", "content_type_conformance",
               "response_headers_conformance", "negative_data_rejection"]


def cap_generation(body, max_model_len: int):
    """``body`` asking for at most ``MAX_TOKENS_CAP`` tokens and ``N_CAP`` sequences where it
    asks for valid larger numbers (or no token limit: then completions make 16 and chat fills
    the context)."""
    if not isinstance(body, dict):
        return body
    present = [k for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None]
    if not present:
        body["max_tokens"] = MAX_TOKENS_CAP
    for k, cap, limit in [(k, MAX_TOKENS_CAP, max_model_len) for k in present] + [("n", N_CAP, MAX_SEQUENCES)]:
        if type(body.get(k)) is int and cap < body[k] <= limit:
            body[k] = cap
    return body


def load_schema(server):
    import schemathesis

    headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}
    return schemathesis.openapi.from_url(server.url + "/openapi.json", headers=headers)


def checks():
    """The check functions of ``CHECK_NAMES``."""
    import schemathesis.checks

    return [getattr(schemathesis.checks, name) for name in CHECK_NAMES]


def register_hooks(max_model_len: int, statuses: Counter) -> None:
    """Global hooks for a run of Schemathesis's CLI in this process: generation capped, each
    answer's status counted by operation in ``statuses``."""
    import schemathesis

    @schemathesis.hook("before_call")
    def capped(ctx, case, **kwargs) -> None:
        if case.operation.label in GENERATING:
            case.body = cap_generation(case.body, max_model_len)

    @schemathesis.hook("after_call")
    def count(ctx, case, response) -> None:
        statuses[(case.operation.label, response.status_code)] += 1
