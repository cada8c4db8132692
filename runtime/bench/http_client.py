"""An HTTP load client: a workload against any OpenAI-compatible server, measured from the client.

    result = asyncio.run(run(ClientConfig(base_url="http://127.0.0.1:8000"), workload))
    print(format_result(result))

The requests are `pipeserve bench`'s (``build_workload``: lengths of a trace or uniform, Poisson
arrivals or all at once), each sent when its arrival time comes (waiting first for a slot when
``max_concurrency`` is set) as one streaming request: ``/v1/completions`` (backend ``openai``) or
``/v1/chat/completions`` (``openai-chat``), greedy, ``max_tokens`` = its output length. From the
stream, per request: the time it was sent, each chunk that carries text (the first: TTFT; the
gaps: TBT, vLLM's ITL), the end (E2E), and the token counts of the stream's usage
(``stream_options.include_usage``). The summary is ``metrics.request_summary``'s, as for an engine
run, except scheduling delay, which cannot be seen from outside the server (left empty).

Prompts are text, as a server's users send it. With a tokenizer (``ClientConfig.tokenizer``: the
model's folder, .gguf or hub id) each prompt decodes random non-special token ids of its length,
as vLLM's random dataset does; without one, random common English words, one per token of its
length (about one token each for Llama-family vocabularies). Either way the server's usage gives
the real counts, and those are what the results report.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import random
import time
from dataclasses import dataclass

from pipeserve.runtime.bench import metrics as M
from pipeserve.runtime.bench.workload import RequestSpec, WorkloadConfig, build_workload, workload_summary

BACKENDS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
WORDS = tuple(
    "the of and to in is that for it as with was on be at by this had not are but from or have an they which one "
    "you were all we her she there would their will can if has more when time who out about some what them so "
    "people year way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work number night point home water".split())


@dataclass(frozen=True, kw_only=True, slots=True)
class ClientConfig:
    base_url: str
    """The server, e.g. http://127.0.0.1:8000 (the routes' /v1/... follow it)."""
    backend: str = "openai"
    """openai: /v1/completions; openai-chat: /v1/chat/completions."""
    model: str | None = None
    """The model named in each request; None = the first of the server's /v1/models."""
    api_key: str | None = None
    """Sent as `Authorization: Bearer <key>` when set."""
    max_concurrency: int | None = None
    """Most requests in flight at once; an arrival beyond it waits for one to finish. None = no limit."""
    ignore_eos: bool = False
    """Ask for every output token (vLLM's `ignore_eos` extension, which pipeserve serves too)."""
    tokenizer: str | None = None
    """The model's tokenizer (a folder, .gguf or hub id) for prompts of random tokens; None = words."""
    timeout_s: float = 600.0
    """Longest one request may take."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {self.backend!r}")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url!r}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")


@dataclass(slots=True)
class Outcome:
    """One request as the client saw it (time.monotonic seconds)."""

    spec: RequestSpec
    sent: float = 0.0
    chunk_times: list[float] = dataclasses.field(default_factory=list)
    finished: float = 0.0
    num_prompt_tokens: int | None = None
    num_output_tokens: int | None = None
    error: str | None = None

    def times(self) -> M.RequestTimes:
        """Its timeline for ``metrics``; a stream without a text chunk has its first token at its end."""
        first = self.chunk_times[0] if self.chunk_times else self.finished
        return M.RequestTimes(str(self.spec.index), arrival=self.sent, first_scheduled=self.sent, first_token=first,
                              token_times=self.chunk_times, finished=self.finished,
                              num_prompt_tokens=self.num_prompt_tokens, num_output_tokens=self.num_output_tokens)


async def run(config: ClientConfig, workload: WorkloadConfig) -> dict:
    """The workload against the server; the result (summary, per-request records)."""
    import aiohttp

    specs = build_workload(workload)
    prompts = prompt_texts(specs, tokenizer=load_tokenizer(config.tokenizer), seed=workload.seed)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    timeout = aiohttp.ClientTimeout(total=config.timeout_s)
    connector = aiohttp.TCPConnector(limit=config.max_concurrency or 0)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector) as session:
        model = config.model or await served_model(session, config.base_url)
        slots = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
        t0 = time.monotonic()
        outcomes = await asyncio.gather(*(
            _timed_request(session, config, model, spec, prompt, t0, slots) for spec, prompt in zip(specs, prompts)))
    return summarize(config, workload, model, specs, outcomes, t0)


async def served_model(session, base_url: str) -> str:
    """The first model of the server's /v1/models."""
    async with session.get(base_url.rstrip("/") + "/v1/models") as resp:
        if resp.status != 200:
            raise ValueError(f"GET /v1/models answered {resp.status}: {(await resp.text())[:200]}")
        return (await resp.json())["data"][0]["id"]


async def _timed_request(session, config: ClientConfig, model: str, spec: RequestSpec, prompt: str, t0: float,
                         slots: asyncio.Semaphore | None) -> Outcome:
    await asyncio.sleep(max(0.0, t0 + spec.arrival_s - time.monotonic()))
    if slots is None:
        return await _request(session, config, model, spec, prompt)
    async with slots:
        return await _request(session, config, model, spec, prompt)


async def _request(session, config: ClientConfig, model: str, spec: RequestSpec, prompt: str) -> Outcome:
    import aiohttp

    out = Outcome(spec)
    body = request_body(config, model, prompt, spec.output_len)
    out.sent = time.monotonic()
    try:
        async with session.post(config.base_url.rstrip("/") + BACKENDS[config.backend], json=body) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
            else:
                await _read_stream(resp, out)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        out.error = f"{type(e).__name__}: {e}"
    out.finished = time.monotonic()
    if out.error is None and out.num_output_tokens is None:
        out.error = "the stream ended without usage (the server ignored stream_options.include_usage)"
    return out


def request_body(config: ClientConfig, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    if config.backend == "openai":
        body |= {"prompt": prompt, "max_tokens": max_tokens}
    else:
        body |= {"messages": [{"role": "user", "content": prompt}], "max_completion_tokens": max_tokens}
    if config.ignore_eos:
        body["ignore_eos"] = True
    return body


async def _read_stream(resp, out: Outcome) -> None:
    """Each SSE event's time if it carries text; the usage; an error event."""
    async for line in resp.content:
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[len(b"data:"):].strip()
        if payload == b"[DONE]":
            return
        event, now = json.loads(payload), time.monotonic()
        if "error" in event:
            out.error = f"error event: {event['error'].get('message', event['error'])}"
            return
        for choice in event.get("choices") or ():
            if choice.get("text") or (choice.get("delta") or {}).get("content"):
                out.chunk_times.append(now)
                break
        if usage := event.get("usage"):
            out.num_prompt_tokens, out.num_output_tokens = usage["prompt_tokens"], usage["completion_tokens"]


def summarize(config: ClientConfig, workload: WorkloadConfig, model: str, specs: list[RequestSpec],
              outcomes: list[Outcome], t0: float) -> dict:
    done = [o for o in outcomes if o.error is None]
    wall = max((o.finished for o in outcomes), default=t0) - t0
    summary = M.request_summary([o.times() for o in done], wall)
    summary["scheduling_delay_s"] = M.distribution(())  # inside the server: not seen from here
    return {
        "date": datetime.datetime.now().isoformat(), "base_url": config.base_url, "backend": config.backend,
        "model": model, "config": {**dataclasses.asdict(config), "api_key": None},
        "workload": {**dataclasses.asdict(workload), **workload_summary(specs)},
        **summary,
        "num_failed": len(outcomes) - len(done),
        "requests": [_record(o) for o in outcomes],
    }


def _record(o: Outcome) -> dict:
    t = o.times()
    return {"index": o.spec.index, "arrival_s": o.spec.arrival_s, "prompt_len": o.spec.prompt_len,
            "max_tokens": o.spec.output_len, "error": o.error, "num_prompt_tokens": o.num_prompt_tokens,
            "num_output_tokens": o.num_output_tokens,
            "ttft_s": None if o.error else t.ttft, "tpot_s": None if o.error else t.tpot,
            "e2e_s": o.finished - o.sent, "itl_s": t.tbts}


def format_result(result: dict) -> str:
    """The printed summary: the latency table of `pipeserve bench`, and the failures."""
    w = result["workload"]
    lines = [f"pipeserve bench serve · {w['name']} · {result['backend']} · {result['model']} · {result['base_url']}",
             *M.format_latency_table(result)]
    if result["num_failed"]:
        first = next(r["error"] for r in result["requests"] if r["error"])
        lines.append(f"failed {result['num_failed']} of {len(result['requests'])} (first: {first})")
    return "\n".join(lines)


# ---- prompts -------------------------------------------------------------------------------------


def load_tokenizer(model: str | None):
    """The tokenizer of a model folder, .gguf file or hub id; None for None."""
    if model is None:
        return None
    from pipeserve.runtime.model.loader import resolve_model_path
    from pipeserve.runtime.model.tokenizer import Tokenizer

    path = resolve_model_path(model)
    return Tokenizer.from_gguf(path) if path.endswith(".gguf") else Tokenizer.from_hf_folder(path)


def prompt_texts(specs: list[RequestSpec], *, tokenizer, seed: int) -> list[str]:
    """One prompt per request, ``prompt_len`` random tokens (or words without a tokenizer)."""
    rng = random.Random(seed)
    if tokenizer is None:
        return [" ".join(rng.choice(WORDS) for _ in range(s.prompt_len)) for s in specs]
    special = set(tokenizer.all_special_ids)

    def token() -> int:
        while (t := rng.randrange(tokenizer.vocab_size)) in special:
            pass
        return t

    return [tokenizer.decode([token() for _ in range(s.prompt_len)]) for s in specs]
