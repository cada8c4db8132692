"""The OpenAI-compatible HTTP server: FastAPI + uvicorn in the frontend process.

    run(engine_config, ServerConfig(port=8000, api_key="..."))    # blocks; returns an exit code

The frontend tokenizes (chat templates included), validates every request exactly as the
engine will, applies admission control and streams what the engine process sends back
(``runtime.frontend``); chat answers are read for tool calls (``tool_calls``). Routes:
``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/v1/requests/{id}/cancel``,
vLLM's ``/tokenize``, ``/detokenize`` and ``/version``, a 404 at ``/v1/embeddings``, ``/health``, ``/metrics`` and ``/openapi.json`` (the request bodies' schemas
and each route's error statuses); with an API key every route but ``/health`` wants
``Authorization: Bearer <key>``. Every answer carries the request's ``X-Request-Id``; CORS and
HTTPS follow the ``ServerConfig``. SIGTERM (or Ctrl-C) stops accepting
connections, lets in-flight requests finish, stops the engine and returns 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import itertools
import json
import logging
import os
import signal
import socket
import threading
import time
import uuid
import dataclasses
from dataclasses import dataclass, field
from functools import lru_cache, partial

import jinja2
import jinja2.sandbox
import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

import pipeserve
from pipeserve.parallel.transport import ALL_INTERFACES
from pipeserve.parallel.wire import TokenLogprobs
from pipeserve.runtime.config import EngineConfig
from pipeserve.runtime.engine.llm_engine import validate_request
from pipeserve.runtime.heap import freeze_start_up_heap
from pipeserve.runtime.serving.frontend import AsyncEngineClient, Delta, EngineProcess
from pipeserve.runtime.model import hub
from pipeserve.runtime.model.loader import read_config_and_tokenizer, resolve_model_path
from pipeserve.runtime.worker.grammar import GrammarCompiler
from pipeserve.runtime.serving.openai_protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    ignored_fields,
    parse,
    template_tools,
)
from pipeserve.runtime.serving.tool_calls import PARSERS, ChoiceToolCalls
from pipeserve.scheduler.sampling_params import SamplingParams, StructuredOutputsParams
from pipeserve.runtime.serving.server_metrics import ServerMetrics

logger = logging.getLogger("pipeserve.server")


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    """Interface to listen on; 127.0.0.1 (this machine only) unless told otherwise."""
    port: int = 8000
    """TCP port; 0 picks a free one (the ready line on stdout says which)."""
    api_key: str | None = None
    """If set, every route but /health wants `Authorization: Bearer <api_key>`."""
    api_key_file: str | None = None
    """A file whose first line is the API key (keeps it out of `ps` and the shell's history);
    used when ``api_key`` is not set."""
    allowed_hosts: list[str] | None = None
    """Host header values the server answers (port stripped; "*" for any). None: localhost,
    127.0.0.1, ::1, the listening address, this machine's name, and any IP address when the
    server listens on every interface. A web page cannot then reach a key-less local server
    through a name it controls (DNS rebinding)."""
    body_timeout_s: float = 30.0
    """Longest a client may take to send a request body; then 408."""
    served_model_name: str | None = None
    """The `model` clients name; None = the checkpoint's file or folder name."""
    max_queue_depth: int = 1024
    """Sequences the server holds beyond the engine's max_num_seqs; past it: 429 + Retry-After."""
    max_sequences_per_request: int = 64
    """Most sequences (prompts × n) one HTTP request may ask for."""
    max_body_bytes: int = 4 * 2**20
    """Larger request bodies are answered 413."""
    retry_after_s: int = 1
    """The Retry-After header of 429/503 answers."""
    drain_timeout_s: float = 120.0
    """On SIGTERM, how long in-flight requests may take before they are cancelled."""
    engine_start_timeout_s: float = 900.0
    """How long the engine (and its workers) may take to load the model."""
    stats_interval_s: float = 0.5
    """How often the engine reports queue and KV figures for /metrics."""
    log_level: str = "warning"
    """uvicorn's; at warning nothing precedes the server's own ready line."""
    access_log: bool = False
    chat_template: str | None = None
    """A Jinja chat template, or a file holding one, used instead of the tokenizer's."""
    allowed_origins: list[str] = field(default_factory=list)
    """CORS: origins whose web pages may read the answers; none by default (vLLM's is any,
    ``["*"]``: then any page the user opens could use a key-less local server)."""
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    """CORS: methods those pages may use."""
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    """CORS: request headers those pages may send."""
    allow_credentials: bool = False
    """CORS: may those pages send cookies or HTTP authentication."""
    ssl_keyfile: str | None = None
    """With ``ssl_certfile``: serve HTTPS with this private key (PEM)."""
    ssl_certfile: str | None = None
    """With ``ssl_keyfile``: serve HTTPS with this certificate chain (PEM)."""
    tool_call_parser: str | None = None
    """How tool_choice "auto" reads calls from the output: ``hermes`` (``<tool_call>{...}
    </tool_call>``: Hermes, Qwen) or ``llama3_json`` (Llama 3.x's JSON calls)."""
    enable_auto_tool_choice: bool = False
    """Serve tool_choice "auto" (the default of a request with tools; else 400, as vLLM);
    needs ``tool_call_parser``."""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"server.port must be in [0, 65535], got {self.port}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("server.api_key must be non-empty (or null for no key)")
        for name in ("max_queue_depth", "retry_after_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"server.{name} must be >= 0")
        for name in ("max_sequences_per_request", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"server.{name} must be >= 1")
        if self.api_key is not None and self.api_key_file is not None:
            raise ValueError("set server.api_key or server.api_key_file, not both")
        if (self.drain_timeout_s <= 0 or self.engine_start_timeout_s <= 0 or self.stats_interval_s <= 0
                or self.body_timeout_s <= 0):
            raise ValueError("server timeouts and intervals must be > 0")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("set both server.ssl_keyfile and server.ssl_certfile (HTTPS), or neither")
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(f"server.tool_call_parser must be one of {', '.join(PARSERS)}, "
                             f"got {self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("server.enable_auto_tool_choice needs server.tool_call_parser")


@dataclass(slots=True)
class _Job:
    """One HTTP request's sequences in the engine (choice index = position in request_ids).
    ``response_id`` is what the client sees (two requests may send the same X-Request-Id);
    ``key`` is unique over the server's life and prefixes the engine's request ids, so a late
    update of an earlier job with the same X-Request-Id never reaches this one."""

    response_id: str
    key: str
    request_ids: list[str]
    queue: asyncio.Queue
    num_prompt_tokens: int
    num_logprobs: int | None
    seqs_per_prompt: int = 1
    created: int = field(default_factory=lambda: int(time.time()))


class ClientGone(Exception):
    pass


class OpenAIServing:
    """Everything behind the routes: validation, admission, submission, response building."""

    def __init__(self, config: ServerConfig, client: AsyncEngineClient, tokenizer, engine_info: dict,
                 model_name: str, metrics: ServerMetrics) -> None:
        self.config, self.client, self.tokenizer = config, client, tokenizer
        self.info, self.model_name, self.metrics = engine_info, model_name, metrics
        self._grammars: GrammarCompiler | None = None
        self.jobs: dict[str, _Job] = {}  # by key
        self.draining = False
        self._ignored_fields: set[str] = set()  # unknown request fields already logged
        self._job_numbers = itertools.count()

    def parse(self, model, body: bytes):
        """The request (ApiError 400 naming a bad field); unknown fields are ignored, and logged
        once per name, as vLLM does."""
        request = parse(model, body)
        if new := [name for name in ignored_fields(request) if name not in self._ignored_fields]:
            self._ignored_fields.update(new)
            logger.warning("The following fields were present in the request but ignored: %s", set(new))
        return request

    # ---- validation and admission ------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"The model `{model}` does not exist (this server has `{self.model_name}`).",
                           param="model", code="model_not_found")

    def sampling_params(self, fields: dict) -> SamplingParams:
        try:
            params = SamplingParams(**fields)
        except (ValueError, TypeError) as e:
            name = str(e).split(" ", 1)[0]
            raise ApiError(400, str(e), param=name if name in fields else None) from None
        if params.structured_outputs is not None:
            self.check_structured_outputs(params.structured_outputs)
        return params

    def check_structured_outputs(self, spec, param: str = "structured_outputs") -> None:
        """A schema, regex or grammar that does not compile is a 400 here, not an engine error
        (the compiler, built on first use, caches what it compiled)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, vocab_size=self.info["vocab_size"],
                                             eos_token_ids=self.info["eos_token_ids"])
        try:
            self._grammars.compile(spec)
        except ValueError as e:
            raise ApiError(400, str(e), param=param) from None

    def tool_calls(self, req: ChatCompletionRequest):
        """Makes a reader of one choice's calls (None: no tools, or tool_choice "none"); a 400 for a
        tool whose parameters are not a JSON schema, or "auto" on a server without it."""
        for tool in req.tools or []:
            if tool.function.parameters is not None:
                self.check_structured_outputs(StructuredOutputsParams(json=tool.function.parameters), "tools")
        choice = req.effective_tool_choice
        if choice == "none":
            return None
        if choice == "auto" and not self.config.enable_auto_tool_choice:
            raise ApiError(400, 'tool_choice "auto" (the default with tools) needs a server started with '
                           "--enable-auto-tool-choice and --tool-call-parser", param="tool_choice")
        return partial(ChoiceToolCalls, choice, parser=self.config.tool_call_parser, parallel=req.parallel_tool_calls,
                       function=req.tool_choice.function.name if choice == "named" else None)

    def checked_prompt(self, ids: list[int], params: SamplingParams, param: str) -> list[int]:
        try:
            _, ids, _ = validate_request(ids, params, tokenizer=self.tokenizer, vocab_size=self.info["vocab_size"],
                                         max_model_len=self.info["max_model_len"])
        except ValueError as e:
            field = next((f for f in ("stop_token_ids", "top_k", "logit_bias", "allowed_token_ids", "max_tokens")
                          if str(e).startswith(f)
                          or (f == "max_tokens" and f in str(e))), param)
            raise ApiError(400, str(e), param=field) from None
        return ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except Exception as e:  # noqa: BLE001 - the tokenizer's own errors on odd input
            raise ApiError(400, f"the prompt cannot be tokenized: {e}", param="prompt") from None

    def render_chat(self, req: ChatCompletionRequest | TokenizeChatRequest) -> list[int]:
        """The prompt ids of a chat (the template's own special tokens, no BOS added)."""
        kwargs = dict(req.chat_template_kwargs or {})
        if req.tools:  # as transformers' apply_chat_template(tools=...)
            kwargs["tools"] = template_tools(req.tools)
        try:
            return self.tokenizer.apply_chat_template(
                [m.as_template_input() for m in req.messages], add_generation_prompt=req.add_generation_prompt,
                tokenize=True, special_tokens_in_content=getattr(req, "special_tokens_in_content", False),
                continue_final_message=req.continue_final_message, **kwargs)
        except Exception as e:  # noqa: BLE001 - a template's raise_exception or a Jinja error
            raise ApiError(400, f"the chat template rejected the messages: {e}", param="messages") from None

    def admit(self, num_seqs: int) -> None:
        if num_seqs > self.config.max_sequences_per_request:
            raise ApiError(400, f"a request may ask for at most {self.config.max_sequences_per_request} "
                           f"sequences (prompts × n), got {num_seqs}", param="n")
        retry = {"Retry-After": str(self.config.retry_after_s)}
        if self.draining or self.client.engine_error is not None:
            raise ApiError(503, "the server is shutting down", type="server_error", code="unavailable",
                           headers=retry)
        limit = self.info["max_num_seqs"] + self.config.max_queue_depth
        if self.client.num_in_flight + num_seqs > limit:
            raise ApiError(429, f"the server is at its queue limit ({limit} sequences in flight); retry later",
                           type="rate_limit_error", code="server_overloaded", headers=retry)

    # ---- submission --------------------------------------------------------------------------

    def submit(self, response_id: str, prompts: list[list[int]], params: SamplingParams, *, stream: bool) -> _Job:
        """Queues n sequences per prompt (seeds offset per sequence, as the offline LLM does)."""
        key = f"{response_id}-{next(self._job_numbers)}"
        job = _Job(response_id, key, [], asyncio.Queue(), sum(len(p) for p in prompts), params.logprobs, params.n)
        try:
            for ids in prompts:
                for j in range(params.n):
                    seq_params = params.clone(n=1, seed=None if params.seed is None else (params.seed + j) % 2**64)
                    rid = f"{key}-{len(job.request_ids)}"
                    self.client.add(rid, ids, seq_params, stream=stream, sink=job.queue, index=len(job.request_ids))
                    job.request_ids.append(rid)
        except BaseException:
            self.client.abort(job.request_ids)  # all of the request or none of it: no orphan sequence
            raise
        self.metrics.on_submitted(job.num_prompt_tokens, params.n)
        self.jobs[key] = job
        return job

    def release(self, job: _Job) -> None:
        """The HTTP request is over: abort what is still running (frees its KV blocks)."""
        self.client.abort(job.request_ids)
        self.jobs.pop(job.key, None)

    def cancel(self, response_id: str) -> bool:
        jobs = [job for job in self.jobs.values() if job.response_id == response_id]
        for job in jobs:
            self.client.abort(job.request_ids)
        return bool(jobs)

    async def collect(self, job: _Job, request: Request) -> list[dict]:
        """Waits for every sequence of a non-streaming request, or raises ClientGone."""
        outs = [dict(token_ids=[], text="", logprobs=[], prompt_logprobs=None, finish_reason=None, stop_reason=None,
                     num_cached_tokens=0) for _ in job.request_ids]

        async def gather() -> None:
            remaining = len(outs)
            while remaining:
                d: Delta = await job.queue.get()
                if d.error is not None:
                    raise ApiError(500, f"generation failed: {d.error}", type="server_error", code="engine_error")
                o = outs[d.index]
                o["token_ids"] += d.token_ids
                o["text"] += d.text
                o["logprobs"] += d.logprobs or []
                if d.prompt_logprobs is not None:
                    o["prompt_logprobs"] = d.prompt_logprobs
                if d.finish_reason is not None:
                    o["finish_reason"], o["stop_reason"] = d.finish_reason, d.stop_reason
                    o["num_cached_tokens"] = d.timings.num_cached_tokens if d.timings is not None else 0
                    remaining -= 1

        await _unless_disconnected(request, gather())
        return outs

    # ---- logprobs ------------------------------------------------------------------------------

    @lru_cache(maxsize=65536)  # noqa: B019 - one server object per process
    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _top(self, lps: TokenLogprobs, k: int) -> list[tuple[int, float]]:
        return [(i, v) for i, (v, _) in sorted(lps.items(), key=lambda kv: -kv[1][0])[:k]]

    def completion_logprobs(self, token_ids: list[int], logprobs: list[TokenLogprobs | None], k: int,
                            offset: int) -> dict:
        """OpenAI's completion logprobs; an entry None (an echoed prompt's first token, which has
        no context) has null logprobs."""
        tokens = [self.token_text(t) for t in token_ids]
        offsets, pos = [], offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [None if lp is None else lp[t][0] for t, lp in zip(token_ids, logprobs)],
            "top_logprobs": [None if lp is None else {self.token_text(i): v for i, v in self._top(lp, k)}
                             for lp in logprobs],
            "text_offset": offsets,
        }

    def chat_logprobs(self, token_ids: list[int], logprobs: list[TokenLogprobs], k: int) -> dict:
        def entry(i: int, v: float) -> dict:
            s = self.token_text(i)
            return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8"))}

        return {"content": [
            {**entry(t, lp[t][0]), "top_logprobs": [entry(i, v) for i, v in self._top(lp, k)]}
            for t, lp in zip(token_ids, logprobs)
        ]}

    def prompt_logprobs(self, entries: list[TokenLogprobs | None] | None) -> list[dict | None] | None:
        """vLLM's ``prompt_logprobs``: per prompt token None (the first) or {token id: {"logprob",
        "rank", "decoded_token"}}, the token's own and the top ones at its position."""
        if entries is None:
            return None
        return [None if lp is None else
                {t: {"logprob": v, "rank": rank, "decoded_token": self.token_text(t)} for t, (v, rank) in lp.items()}
                for lp in entries]

    def usage(self, job: _Job, num_completion_tokens: int, num_cached_tokens: list[int]) -> dict:
        """OpenAI's usage; ``prompt_tokens_details.cached_tokens`` counts each prompt's tokens the
        prefix cache served to its first sequence (``num_cached_tokens``: per sequence), null when
        none were."""
        cached = sum(num_cached_tokens[::job.seqs_per_prompt])
        return {"prompt_tokens": job.num_prompt_tokens, "completion_tokens": num_completion_tokens,
                "total_tokens": job.num_prompt_tokens + num_completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached} if cached else None}


async def _unless_disconnected(request: Request, work):
    """Runs `work`; if the client hangs up first, cancels it and raises ClientGone."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    raise ClientGone()


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


# ---- routes ---------------------------------------------------------------------------------------


async def read_body(request: Request, config: ServerConfig) -> bytes:
    """The whole body: 413 past ``max_body_bytes``, 408 when it takes longer than
    ``body_timeout_s``; ClientGone when the client hangs up before it is in."""
    limit = config.max_body_bytes
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ApiError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(config.body_timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise ApiError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {config.body_timeout_s:g} s",
                       code="request_timeout") from None
    except ClientDisconnect:
        raise ClientGone() from None
    return b"".join(chunks)


def request_id(request: Request) -> str:
    """The client's X-Request-Id, or the one ``_RequestId`` made up."""
    return request.scope["state"]["request_id"]


def _truncated(ids: list[int], k: int | None) -> list[int]:
    return ids if k is None else ids[-k:]


async def completions(request: Request, s: OpenAIServing) -> Response:
    req: CompletionRequest = s.parse(CompletionRequest, await read_body(request, s.config))
    req.check_unsupported()
    s.check_model(req.model)
    params = s.sampling_params(dict(req.sampling_fields(), n=req.n, max_tokens=req.max_tokens,
                                    logprobs=req.logprobs))
    prompts = [s.checked_prompt(_truncated(s.encode(p) if isinstance(p, str) else p, req.truncate_prompt_tokens),
                                params, "prompt") for p in req.prompts()]
    echo = echo_ids = None
    if req.echo:  # each choice's text begins with its prompt (the text given, or the ids' text)
        echo = [p if isinstance(p, str) and req.truncate_prompt_tokens is None else
                s.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
                for p, ids in zip(req.prompts(), prompts) for _ in range(params.n)]
        if req.logprobs is not None:  # and its logprobs begin with its prompt's
            echo_ids = [ids for ids in prompts for _ in range(params.n)]
    s.admit(len(prompts) * params.n)
    job = s.submit(f"cmpl-{request_id(request)}", prompts, params, stream=req.stream)
    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        return _JobStream(_completion_events(s, job, include_usage, echo, echo_ids), s, job)
    try:
        outs = await s.collect(job, request)
    except ClientGone:
        return Response(status_code=499)
    finally:
        s.release(job)
    choices = [{
        "index": i, "text": (echo[i] if echo else "") + o["text"], "finish_reason": o["finish_reason"],
        "stop_reason": o["stop_reason"], "logprobs": None if job.num_logprobs is None else
        s.completion_logprobs(*_echoed(o, None if echo_ids is None else echo_ids[i]), job.num_logprobs, 0),
        "prompt_logprobs": s.prompt_logprobs(o["prompt_logprobs"]),
    } for i, o in enumerate(outs)]
    return JSONResponse({
        "id": job.response_id, "object": "text_completion", "created": job.created, "model": s.model_name,
        "choices": choices, "usage": s.usage(job, sum(len(o["token_ids"]) for o in outs),
                                             [o["num_cached_tokens"] for o in outs]),
    })


def _echoed(o: dict, prompt_ids: list[int] | None) -> tuple[list[int], list]:
    """A choice's token ids and logprobs, after its prompt's where echoed (``prompt_ids``)."""
    if prompt_ids is None:
        return o["token_ids"], o["logprobs"]
    return prompt_ids + o["token_ids"], o["prompt_logprobs"] + o["logprobs"]


async def _completion_events(s: OpenAIServing, job: _Job, include_usage: bool, echo: list[str] | None,
                             echo_ids: list[list[int]] | None):
    """``echo``: each choice's prompt text, sent with its first chunk; ``echo_ids`` (with
    logprobs): its prompt's ids, whose logprobs go with that chunk too."""
    remaining, num_tokens = len(job.request_ids), 0
    offsets = [0] * len(job.request_ids)
    cached = [0] * len(job.request_ids)
    base = {"id": job.response_id, "object": "text_completion", "created": job.created, "model": s.model_name}
    while remaining:
        d: Delta = await job.queue.get()
        if d.error is not None:
            yield _sse({"error": ApiError(500, f"generation failed: {d.error}", type="server_error").body()["error"]})
            return
        num_tokens += len(d.token_ids)
        remaining -= d.finish_reason is not None
        if d.timings is not None:
            cached[d.index] = d.timings.num_cached_tokens
        text, token_ids, token_logprobs = d.text, d.token_ids, d.logprobs or []
        if echo and echo[d.index] is not None:  # the prompt goes out with the choice's first chunk
            text, echo[d.index] = echo[d.index] + text, None
            if echo_ids is not None:
                token_ids, token_logprobs = echo_ids[d.index] + token_ids, d.prompt_logprobs + token_logprobs
        if not text and d.finish_reason is None and job.num_logprobs is None:
            continue  # tokens whose text is held back (incomplete character, possible stop string)
        logprobs = None
        if job.num_logprobs is not None:
            logprobs = s.completion_logprobs(token_ids, token_logprobs, job.num_logprobs, offsets[d.index])
        offsets[d.index] += len(text)
        choice = {"index": d.index, "text": text, "logprobs": logprobs, "finish_reason": d.finish_reason,
                  "stop_reason": d.stop_reason}
        yield _sse({**base, "choices": [choice], **({"usage": None} if include_usage else {})})
    if include_usage:
        yield _sse({**base, "choices": [], "usage": s.usage(job, num_tokens, cached)})
    yield _sse("[DONE]")


async def tokenize(request: Request, s: OpenAIServing) -> Response:
    """vLLM's /tokenize: a prompt, or chat messages rendered as /v1/chat/completions renders them."""
    body = await read_body(request, s.config)
    try:
        is_chat = "messages" in json.loads(body)
    except (ValueError, TypeError):
        is_chat = False  # parse() says what is wrong with it
    req = s.parse(TokenizeChatRequest if is_chat else TokenizeCompletionRequest, body)
    s.check_model(req.model)
    if is_chat:
        req.check_unsupported()
        ids = s.render_chat(req)
        if req.add_special_tokens and s.tokenizer.add_bos_token:
            ids = [s.tokenizer.bos_token_id, *ids]
    else:
        ids = s.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    return JSONResponse({"count": len(ids), "max_model_len": s.info["max_model_len"], "tokens": ids,
                         "token_strs": [s.token_text(i) for i in ids] if req.return_token_strs else None})


async def detokenize(request: Request, s: OpenAIServing) -> Response:
    """vLLM's /detokenize: the text of token ids (special tokens kept)."""
    req: DetokenizeRequest = s.parse(DetokenizeRequest, await read_body(request, s.config))
    s.check_model(req.model)
    vocab_size = s.info["vocab_size"]
    if bad := [t for t in req.tokens if not 0 <= t < vocab_size]:
        raise ApiError(400, f"token ids must be in [0, {vocab_size}), got {bad[0]}", param="tokens")
    return JSONResponse({"prompt": s.tokenizer.decode(req.tokens, skip_special_tokens=False)})


async def chat_completions(request: Request, s: OpenAIServing) -> Response:
    req: ChatCompletionRequest = s.parse(ChatCompletionRequest, await read_body(request, s.config))
    req.check_unsupported()
    s.check_model(req.model)
    tool_calls = s.tool_calls(req)
    params = s.sampling_params(dict(req.sampling_fields(), n=req.n, max_tokens=req.token_limit,
                                    logprobs=req.num_logprobs))
    prompt = s.checked_prompt(_truncated(s.render_chat(req), req.truncate_prompt_tokens), params, "messages")
    s.admit(params.n)
    job = s.submit(f"chatcmpl-{request_id(request)}", [prompt], params, stream=req.stream)
    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        return _JobStream(_chat_events(s, job, include_usage, tool_calls), s, job)
    try:
        outs = await s.collect(job, request)
    except ClientGone:
        return Response(status_code=499)
    finally:
        s.release(job)
    messages = [_chat_message(o["text"], tool_calls) for o in outs]
    choices = [{
        "index": i, "message": m, "finish_reason": _finish_reason(o["finish_reason"], "tool_calls" in m),
        "stop_reason": o["stop_reason"], "logprobs": None if job.num_logprobs is None else
        s.chat_logprobs(o["token_ids"], o["logprobs"], job.num_logprobs),
    } for i, (o, m) in enumerate(zip(outs, messages))]
    return JSONResponse({
        "id": job.response_id, "object": "chat.completion", "created": job.created, "model": s.model_name,
        "choices": choices, "usage": s.usage(job, sum(len(o["token_ids"]) for o in outs),
                                             [o["num_cached_tokens"] for o in outs]),
        "prompt_logprobs": s.prompt_logprobs(outs[0]["prompt_logprobs"]),
    })


def _chat_message(text: str, tool_calls) -> dict:
    """The assistant message of a choice: its text, or the calls in it and the text around them."""
    if tool_calls is None:
        return {"role": "assistant", "content": text}
    content, calls = tool_calls().message(text)
    return {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}


def _finish_reason(finish_reason: str | None, called: bool) -> str | None:
    """OpenAI's "tool_calls" for an output that ended by itself with calls."""
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


async def _chat_events(s: OpenAIServing, job: _Job, include_usage: bool, tool_calls):
    base = {"id": job.response_id, "object": "chat.completion.chunk", "created": job.created, "model": s.model_name}
    extra = {"usage": None} if include_usage else {}

    def chunk(index: int, delta: dict, finish_reason=None, logprobs=None, stop_reason=None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        return _sse({**base, "choices": [choice], **extra})

    readers = None if tool_calls is None else [tool_calls() for _ in job.request_ids]
    for i in range(len(job.request_ids)):
        yield chunk(i, {"role": "assistant", "content": ""})
    remaining, num_tokens = len(job.request_ids), 0
    cached = [0] * len(job.request_ids)
    while remaining:
        d: Delta = await job.queue.get()
        if d.error is not None:
            yield _sse({"error": ApiError(500, f"generation failed: {d.error}", type="server_error").body()["error"]})
            return
        num_tokens += len(d.token_ids)
        remaining -= d.finish_reason is not None
        if d.timings is not None:
            cached[d.index] = d.timings.num_cached_tokens
        if not d.text and d.finish_reason is None and job.num_logprobs is None:
            continue
        logprobs = None
        if job.num_logprobs is not None:
            logprobs = s.chat_logprobs(d.token_ids, d.logprobs or [], job.num_logprobs)
        if readers is None:
            yield chunk(d.index, {"content": d.text} if d.text else {}, d.finish_reason, logprobs, d.stop_reason)
        else:
            for args in _tool_chunks(readers[d.index], d, logprobs):
                yield chunk(d.index, *args)
    if include_usage:
        yield _sse({**base, "choices": [], "usage": s.usage(job, num_tokens, cached)})
    yield _sse("[DONE]")


def _tool_chunks(reader: ChoiceToolCalls, d: Delta, logprobs) -> list[tuple]:
    """(delta, finish_reason, logprobs, stop_reason) of each chunk an engine delta makes when its
    text is read for calls: none while the reader holds text back, or several; the logprobs go
    with the first, the finish with the last."""
    deltas = reader.feed(d.text) + (reader.finish() if d.finish_reason is not None else [])
    if not deltas and (d.finish_reason is not None or logprobs is not None):
        deltas = [{}]
    finish_reason = _finish_reason(d.finish_reason, reader.num_calls > 0)
    return [(delta, finish_reason if k == len(deltas) - 1 else None, logprobs if k == 0 else None, d.stop_reason)
            for k, delta in enumerate(deltas)]


class _JobStream(StreamingResponse):
    """Server-sent events of one job; however the response ends (finished, failed, the client
    gone before or while streaming) the job's unfinished sequences are aborted."""

    def __init__(self, events, s: OpenAIServing, job: _Job) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._release = lambda: s.release(job)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


# ---- the OpenAPI document ----------------------------------------------------------------------

_DOCUMENTED_MODELS = (CompletionRequest, ChatCompletionRequest, TokenizeCompletionRequest, TokenizeChatRequest,
                      DetokenizeRequest, ErrorResponse)
_ERROR_DESCRIPTIONS = {
    400: "a bad request (JSON, types, values, a prompt over the context) or a Host header not "
         "naming this server",
    401: "missing or wrong API key",
    404: "no such model, route or request",
    408: "the body did not arrive within server.body_timeout_s",
    413: "the body is larger than server.max_body_bytes",
    415: "a body that is not sent as application/json",
    429: "over the queue limit; retry after Retry-After seconds",
    500: "the generation failed (the engine or a worker died), or an internal error",
    503: "draining (SIGTERM) or the engine is gone",
}


def _errors(*statuses: int) -> dict:
    # JSON whatever the route's own media type (/metrics answers text/plain).
    content = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    return {status: {"description": _ERROR_DESCRIPTIONS[status], "content": content} for status in statuses}


def _json_body(*models) -> dict:
    """``openapi_extra`` of a route that parses its own body (to bound its size and time, and
    to parse strictly), so FastAPI does not see the model(s) it reads."""
    refs = [{"$ref": f"#/components/schemas/{model.__name__}"} for model in models]
    schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def openapi_document(app: FastAPI) -> dict:
    """FastAPI's document of the routes, plus the schemas of the request bodies (``_json_body``)
    and of the error body (``_errors``)."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        _, defs = models_json_schema([(m, "validation") for m in _DOCUMENTED_MODELS],
                                     ref_template="#/components/schemas/{model}")
        doc.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
        app.openapi_schema = doc
    return app.openapi_schema


def build_app(s: OpenAIServing) -> FastAPI:
    """The routes. ``/openapi.json`` describes them (as vLLM serves it; no docs pages): the
    request bodies' schemas and every error status a route can answer."""
    app = FastAPI(title="pipeserve", version=pipeserve.__version__, docs_url=None, redoc_url=None)
    app.openapi = partial(openapi_document, app)
    keyed = (401,) if s.config.api_key is not None else ()
    stream = {200: {"description": "the response; `text/event-stream` when `stream` is true",
                    "content": {"text/event-stream": {}}}}
    generate = stream | _errors(400, *keyed, 404, 408, 413, 415, 429, 500, 503)

    @app.get("/health", responses=_errors(400, 503))
    async def health() -> Response:
        if s.draining or s.client.engine_error is not None:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models", responses=_errors(400, *keyed))
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": s.model_name, "object": "model", "created": 0, "owned_by": "pipeserve",
            "max_model_len": s.info["max_model_len"],
        }]})

    @app.get("/metrics", response_class=PlainTextResponse, responses=_errors(400, *keyed))
    async def metrics() -> Response:
        s.metrics.num_in_flight.set(s.client.num_in_flight)
        return Response(s.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions", responses=generate, openapi_extra=_json_body(CompletionRequest))
    async def post_completions(request: Request) -> Response:
        return await completions(request, s)

    @app.post("/v1/chat/completions", responses=generate, openapi_extra=_json_body(ChatCompletionRequest))
    async def post_chat_completions(request: Request) -> Response:
        return await chat_completions(request, s)

    @app.post("/tokenize", responses=_errors(400, *keyed, 404, 408, 413, 415),
              openapi_extra=_json_body(TokenizeCompletionRequest, TokenizeChatRequest))
    async def post_tokenize(request: Request) -> Response:
        return await tokenize(request, s)

    @app.post("/detokenize", responses=_errors(400, *keyed, 404, 408, 413, 415),
              openapi_extra=_json_body(DetokenizeRequest))
    async def post_detokenize(request: Request) -> Response:
        return await detokenize(request, s)

    @app.get("/version", responses=_errors(400, *keyed))
    async def version() -> Response:
        return JSONResponse({"version": pipeserve.__version__})

    @app.post("/v1/embeddings", responses=_errors(400, *keyed, 404, 415))
    async def embeddings() -> Response:
        raise ApiError(404, f"this server has no embedding model (it serves the generative model "
                       f"`{s.model_name}`): /v1/embeddings is not available", code="model_not_found")

    @app.post("/v1/requests/{response_id}/cancel", responses=_errors(400, *keyed, 404))
    async def cancel(response_id: str) -> Response:
        if not s.cancel(response_id):
            raise ApiError(404, f"no request {response_id!r} is in flight", param="response_id")
        return JSONResponse({"id": response_id, "object": "request.cancelled", "cancelled": True})

    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> Response:
        s.metrics.on_rejected(e.status)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> Response:
        s.metrics.on_rejected(e.status_code)
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        # e.headers: the 405's Allow, which RFC 9110 requires.
        return JSONResponse(ApiError(e.status_code, str(e.detail), code=code).body(), status_code=e.status_code,
                            headers=e.headers)

    # Each middleware added wraps the ones before: the last is the outermost.
    if s.config.api_key is not None:
        app.add_middleware(_RequireApiKey, api_key=s.config.api_key, on_reject=s.metrics.on_rejected)
    app.add_middleware(CORSMiddleware, allow_origins=s.config.allowed_origins, allow_methods=s.config.allowed_methods,
                       allow_headers=s.config.allowed_headers, allow_credentials=s.config.allow_credentials)
    app.add_middleware(_RequestGuard, allowed_hosts=allowed_hosts(s.config), on_reject=s.metrics.on_rejected)
    app.add_middleware(_RequestId)
    return app


def allowed_hosts(config: ServerConfig) -> frozenset[str] | None:
    """The Host header values the server answers (lower case, no port); None: any."""
    if config.allowed_hosts is not None:
        hosts = {h.lower().strip("[]") for h in config.allowed_hosts}
        return None if "*" in hosts else frozenset(hosts)
    return frozenset({"localhost", "127.0.0.1", "::1", config.host.lower().strip("[]"),
                      socket.gethostname().lower(), socket.getfqdn().lower()})


def _host_of(header: str) -> str:
    """The host of a Host header, lower case, without its port ("[::1]:8000" -> "::1")."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


class _RequestGuard:
    """ASGI middleware around everything else:

    - the Host header must name this server (``allowed_hosts``; any IP address too when it
      listens on every interface): a page that rebinds its own name to 127.0.0.1 gets a 400;
    - a POST with a body must say ``Content-Type: application/json`` (415 otherwise): a web page
      can send a text/plain POST without asking the browser's CORS preflight first;
    - an error escaping a route is a 500 answer on a connection that stays open (a pooled client
      keeps its connection), logged once; a client that hung up mid-request is no error at all."""

    def __init__(self, app, allowed_hosts: frozenset[str] | None, on_reject) -> None:
        self.app, self.allowed, self.on_reject = app, allowed_hosts, on_reject
        self.any_ip = False
        if allowed_hosts is not None:
            self.any_ip = any(h in ALL_INTERFACES for h in allowed_hosts)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if error := self._refusal(scope, headers):
            self.on_reject(error.status)
            return await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)
        started = False

        async def tracked(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except (ClientGone, ClientDisconnect):
            self.on_reject(499)
        except Exception as e:  # noqa: BLE001 - the last place to answer instead of dropping the connection
            logger.exception("internal error")
            self.on_reject(500)
            if not started:
                body = ApiError(500, f"internal error: {type(e).__name__}", type="server_error").body()
                await JSONResponse(body, status_code=500)(scope, receive, send)

    def _refusal(self, scope, headers: dict) -> ApiError | None:
        host = _host_of(headers.get(b"host", b"").decode("latin-1"))
        if self.allowed is not None and host not in self.allowed and not (self.any_ip and _is_ip(host)):
            return ApiError(400, f"the Host header {host!r} is not one of this server's names "
                            "(server.allowed_hosts)", code="host_not_allowed")
        has_body = headers.get(b"content-length", b"0") not in (b"0", b"") or b"transfer-encoding" in headers
        if scope["method"] == "POST" and has_body:
            media = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
            if media != b"application/json":
                return ApiError(415, "the request body must be JSON, sent with `Content-Type: application/json`",
                                code="unsupported_media_type")
        return None


class _RequestId:
    """ASGI middleware around everything: the request's id is its ``X-Request-Id`` header, or a
    new one; the routes name their responses after it ("cmpl-<id>") and every answer carries
    it back as ``X-Request-Id``."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1").strip()
        rid = given or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid

        async def with_id(message) -> None:
            if message["type"] == "http.response.start":
                message = dict(message, headers=[*message.get("headers", []),
                                                 (b"x-request-id", rid.encode("latin-1"))])
            await send(message)

        await self.app(scope, receive, with_id)


class _RequireApiKey:
    """ASGI middleware: every HTTP request but GET /health needs `Authorization: Bearer <key>`
    (unknown routes too, so they reveal nothing without it). The CORS middleware around it
    answers browsers' preflights, which carry no credentials."""

    def __init__(self, app, api_key: str, on_reject) -> None:
        self.app, self.on_reject = app, on_reject
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        self.on_reject(401)
        e = ApiError(401, "missing or wrong API key (send `Authorization: Bearer <key>`)", code="invalid_api_key",
                     headers={"WWW-Authenticate": "Bearer"})
        await JSONResponse(e.body(), status_code=401, headers=e.headers)(scope, receive, send)


# ---- the process -------------------------------------------------------------------------------


class _Server(uvicorn.Server):
    """uvicorn, but SIGTERM/SIGINT mark the server draining (503 to new requests on kept-alive
    connections) and a drained shutdown exits cleanly instead of re-raising the signal."""

    def __init__(self, config: uvicorn.Config, serving: OpenAIServing, url: str) -> None:
        super().__init__(config)
        self.serving, self.url = serving, url

    def handle_exit(self, sig, frame) -> None:
        self.serving.draining = True
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            print(f"pipeserve: serving {self.serving.model_name} on {self.url} "
                  f"(engine pid {self.serving.info['pid']})", flush=True)


def with_api_key_from_file(config: ServerConfig) -> ServerConfig:
    """``config`` with ``api_key`` read from ``api_key_file`` (its first line); ValueError if the
    file cannot be read or holds no key."""
    if config.api_key_file is None:
        return config
    try:
        with open(config.api_key_file) as f:
            key = f.readline().strip()
    except OSError as e:
        raise ValueError(f"server.api_key_file: cannot read {config.api_key_file} ({e.strerror})") from None
    if not key:
        raise ValueError(f"server.api_key_file: {config.api_key_file} holds no key on its first line")
    return dataclasses.replace(config, api_key=key, api_key_file=None)


def default_model_name(model: str | None) -> str:
    """The embedded model's name, a hub id for a model given by one (its snapshot folder in
    the hub cache), else the folder's or file's name."""
    if model is None:
        return "SmolLM2-135M-Instruct"
    path = resolve_model_path(model)
    return hub.repo_id_of(path) or os.path.basename(os.path.normpath(path)).removesuffix(".gguf")


def load_chat_template(value: str) -> str:
    """``server.chat_template``: a file's contents, or the template itself (as vLLM tells them
    apart: a value holding "{", "}" or a newline is a template); ValueError if it is neither or
    does not parse."""
    if os.path.isfile(value):
        with open(value) as f:
            value = f.read()
    elif not any(c in value for c in "{}\n"):
        raise ValueError(f"server.chat_template: {value!r} is neither a file nor a Jinja template")
    try:
        jinja2.sandbox.ImmutableSandboxedEnvironment().parse(value)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"server.chat_template does not parse: {e}") from None
    return value


def run(engine_config: EngineConfig, config: ServerConfig) -> int:
    """Starts the engine process, serves HTTP until SIGTERM/SIGINT (or the engine exits)."""
    chat_template = None if config.chat_template is None else load_chat_template(config.chat_template)
    engine = EngineProcess.spawn(engine_config, stats_interval_s=config.stats_interval_s)
    try:
        _, tokenizer, _ = read_config_and_tokenizer(engine_config.model)  # while the engine loads
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        engine.wait_ready(timeout_s=config.engine_start_timeout_s)
        return asyncio.run(_serve(engine, tokenizer, engine_config, config))
    finally:
        engine.stop(grace_s=5.0)


async def _serve(engine: EngineProcess, tokenizer, engine_config: EngineConfig, config: ServerConfig) -> int:
    model_name = config.served_model_name or default_model_name(engine_config.model)
    metrics = ServerMetrics(model_name, engine.info["max_model_len"])
    serving: OpenAIServing | None = None

    def on_delta(d: Delta) -> None:
        metrics.on_tokens(len(d.token_ids))
        if d.finish_reason is not None:
            metrics.on_finished(d.finish_reason, d.timings)

    def on_stats(stats) -> None:
        metrics.on_stats(stats)
        if stats.draining and serving is not None:
            serving.draining = True  # the engine got SIGTERM itself: drain with it

    client = AsyncEngineClient(engine, on_stats=on_stats, on_delta=on_delta)
    serving = OpenAIServing(config, client, tokenizer, engine.info, model_name, metrics)
    uv_config = uvicorn.Config(build_app(serving), host=config.host, port=config.port,
                               log_level=config.log_level, access_log=config.access_log,
                               timeout_graceful_shutdown=config.drain_timeout_s, lifespan="off",
                               ssl_keyfile=config.ssl_keyfile, ssl_certfile=config.ssl_certfile)
    sock = uv_config.bind_socket()
    host, port = sock.getsockname()[:2]
    scheme = "http" if config.ssl_certfile is None else "https"
    url = f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"
    server = _Server(uv_config, serving, url)
    engine_exit: list[int] = []

    def on_engine_exit(code: int) -> None:
        engine_exit.append(code)
        serving.draining = True
        server.should_exit = True

    await client.start(on_engine_exit=on_engine_exit)
    freeze_start_up_heap()  # this process serves until it exits: full collections skip the app and tokenizer
    try:
        await server.serve(sockets=[sock])
    finally:
        code = await client.close(grace_s=30.0)
    if engine_exit:  # the engine ended first: drained after its own SIGTERM (0), or died
        if engine_exit[0] != 0:
            logger.error("the engine process exited with code %s", engine_exit[0])
        return 0 if engine_exit[0] == 0 and serving.draining else 1
    return 0 if code in (0, None) else 1
