"""Prometheus metrics of the HTTP server (prometheus-client, one registry per server).

Engine-side values (queue, KV blocks, stage busy time) arrive in the engine's periodic
``EngineStats``; per-request latencies in the ``RequestTimings`` of each request's last
update (measured by the engine from arrival); token counts as deltas arrive.

Per pipeline stage (label ``stage``): ``pipeserve:stage_busy_seconds_total`` counts the
seconds the stage computed micro-batches; ``pipeserve:stage_bubble_fraction`` is
``1 - busy/active`` over the last ``_BUBBLE_WINDOW_S`` seconds during which the engine had
requests (idle time is not a bubble: the gauge holds its value while the server is idle).
With tp × pp > 1 each stage's TP rank 0 reports on its heartbeat, so figures trail by up to
a heartbeat interval (1 s).

Beside them, the ``vllm:`` series that vLLM documents, with its names, types, buckets and
label ``model_name``, so dashboards and alerts written for vLLM read this server unchanged.
A "request" there is one sequence (n > 1 counts n, as vLLM's child requests do).
"""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pipeserve.parallel.wire import EngineStats, RequestTimings
from pipeserve.runtime.bench.metrics import BubbleWindow

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TBT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py).
_VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                      10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0)
_VLLM_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                         240.0, 480.0, 960.0, 1920.0, 7680.0)
_RATE_WINDOW_S = 5.0
_BUBBLE_WINDOW_S = 10.0


def token_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's 1-2-5 buckets up to the context length: 1, 2, 5, 10, 20, 50, … <= max_model_len."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_model_len:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


class ServerMetrics:
    def __init__(self, model_name: str, max_model_len: int = 2048) -> None:
        self.registry = r = CollectorRegistry()
        m = ["model_name"]

        def gauge(name: str, doc: str):
            return Gauge(name, doc, m, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets):
            return Histogram(name, doc, m, buckets=buckets, registry=r).labels(model_name)

        self.num_waiting = gauge("pipeserve:num_requests_waiting", "Requests waiting to be scheduled.")
        self.num_running = gauge("pipeserve:num_requests_running", "Requests the scheduler is running.")
        self.num_in_flight = gauge("pipeserve:num_requests_in_flight",
                                   "Sequences the frontend has sent to the engine and not seen finish.")
        self.kv_usage = gauge("pipeserve:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).")
        self.kv_blocks_total = gauge("pipeserve:kv_cache_blocks_total", "KV-cache blocks in the pool.")
        self.kv_blocks_used = gauge("pipeserve:kv_cache_blocks_used", "KV-cache blocks held by requests.")
        self.tokens_per_s = gauge("pipeserve:generation_tokens_per_second",
                                  f"Output tokens per second over the last {_RATE_WINDOW_S:g} s.")
        self._stage_bubble = Gauge("pipeserve:stage_bubble_fraction",
                                   f"Per pipeline stage, 1 - busy/wall over the last {_BUBBLE_WINDOW_S:g} s"
                                   " during which the engine had requests.", ["model_name", "stage"],
                                   registry=r)
        self._stage_busy = Counter("pipeserve:stage_busy_seconds",
                                   "Per pipeline stage, seconds spent computing micro-batches.",
                                   ["model_name", "stage"], registry=r)
        self.ttft = histogram("pipeserve:time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.tbt = histogram("pipeserve:time_per_output_token_seconds", "Time between output tokens.",
                             _TBT_BUCKETS)
        self.e2e = histogram("pipeserve:e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS)
        self.queue_time = histogram("pipeserve:request_queue_time_seconds",
                                    "Arrival to first scheduled (scheduling delay).", _LATENCY_BUCKETS)
        self.prompt_tokens = Counter("pipeserve:prompt_tokens", "Prompt tokens received.", m,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("pipeserve:generation_tokens", "Output tokens generated.", m,
                                         registry=r).labels(model_name)
        self._finished = Counter("pipeserve:request_success", "Finished sequences by finish reason.",
                                 ["model_name", "finished_reason"], registry=r)
        self._rejected = Counter("pipeserve:requests_rejected", "HTTP requests answered with an error, "
                                 "by status code.", ["model_name", "status"], registry=r)
        self.control_plane_rejected = Counter(
            "pipeserve:control_plane_rejected", "Control-plane connections refused (without the run's key)"
            " and frames dropped as malformed, on the engine's and the workers' sockets.", m,
            registry=r).labels(model_name)
        self.vllm = _VllmMetrics(r, model_name, max_model_len)
        self._model_name = model_name
        self._num_rejected = 0  # as last reported, to turn the total into increments
        self._generated = 0
        self._samples: deque[tuple[float, int]] = deque()
        self._bubbles = BubbleWindow(_BUBBLE_WINDOW_S)
        self._stage_busy_s: list[float] = []  # as last reported, to turn totals into increments

    def on_stats(self, s: EngineStats) -> None:
        used = s.num_kv_blocks - s.num_free_kv_blocks
        self.num_waiting.set(s.num_waiting)
        self.num_running.set(s.num_running)
        self.kv_blocks_total.set(s.num_kv_blocks)
        self.kv_blocks_used.set(used)
        self.kv_usage.set(used / s.num_kv_blocks if s.num_kv_blocks else 0.0)
        self._update_stages(s.stage_busy_s, s.active_s)
        self.control_plane_rejected.inc(max(0, s.num_rejected - self._num_rejected))
        self._num_rejected = max(self._num_rejected, s.num_rejected)
        self.vllm.on_stats(s)
        self._update_rate()

    def _update_stages(self, busy_s: list[float], active_s: float) -> None:
        last = self._stage_busy_s + [0.0] * (len(busy_s) - len(self._stage_busy_s))
        for stage, (before, now) in enumerate(zip(last, busy_s)):
            self._stage_busy.labels(self._model_name, str(stage)).inc(max(0.0, now - before))
        self._stage_busy_s = [max(a, b) for a, b in zip(last, busy_s)]
        if busy_s:
            self._bubbles.add(busy_s, active_s)
        for stage, bubble in enumerate(self._bubbles.bubble_fractions() or []):
            self._stage_bubble.labels(self._model_name, str(stage)).set(bubble)

    def on_submitted(self, num_prompt_tokens: int, n: int) -> None:
        """An HTTP request's prompts (``num_prompt_tokens`` in all), each sampled ``n`` times."""
        self.prompt_tokens.inc(num_prompt_tokens)
        self.vllm.prompt_tokens.inc(num_prompt_tokens * n)

    def on_tokens(self, num_tokens: int) -> None:
        self._generated += num_tokens
        self.generation_tokens.inc(num_tokens)
        self.vllm.generation_tokens.inc(num_tokens)

    def on_finished(self, finish_reason: str, timings: RequestTimings | None) -> None:
        self._finished.labels(self._model_name, finish_reason).inc()
        self.vllm.on_finished(finish_reason, timings)
        if timings is None:
            return
        if timings.ttft_s is not None:
            self.ttft.observe(timings.ttft_s)
        if timings.queue_s is not None:
            self.queue_time.observe(timings.queue_s)
        self.e2e.observe(timings.e2e_s)
        for gap in timings.tbt_s:
            self.tbt.observe(gap)

    def on_rejected(self, status: int) -> None:
        self._rejected.labels(self._model_name, str(status)).inc()

    def _update_rate(self) -> None:
        now = time.monotonic()
        self._samples.append((now, self._generated))
        while self._samples and now - self._samples[0][0] > _RATE_WINDOW_S:
            self._samples.popleft()
        t0, n0 = self._samples[0]
        self.tokens_per_s.set((self._generated - n0) / (now - t0) if now > t0 else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _VllmMetrics:
    """vLLM's series (docs.vllm.ai, "Production Metrics"), fed from the same events."""

    def __init__(self, r: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        m = [model_name]

        def metric(kind, name: str, doc: str, **kw):
            return kind(name, doc, ["model_name"], registry=r, **kw).labels(*m)

        self.num_running = metric(Gauge, "vllm:num_requests_running", "Number of requests in model execution batches.")
        self.num_waiting = metric(Gauge, "vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = metric(Gauge, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.gpu_cache_usage = metric(Gauge, "vllm:gpu_cache_usage_perc",
                                      "GPU KV-cache usage. 1 means 100 percent usage (vLLM's older name).")
        self.prompt_tokens = metric(Counter, "vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = metric(Counter, "vllm:generation_tokens", "Number of generation tokens processed.")
        self.preemptions = metric(Counter, "vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prefix_queries = metric(Counter, "vllm:prefix_cache_queries",
                                     "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = metric(Counter, "vllm:prefix_cache_hits",
                                  "Prefix cache hits, in terms of number of cached tokens.")
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                ["model_name", "finished_reason"], registry=r)
        self.ttft = metric(Histogram, "vllm:time_to_first_token_seconds", "Histogram of time to first token in "
                           "seconds.", buckets=_VLLM_TTFT_BUCKETS)
        self.itl = metric(Histogram, "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in "
                          "seconds.", buckets=_VLLM_ITL_BUCKETS)
        self.tpot = metric(Histogram, "vllm:time_per_output_token_seconds", "Histogram of time per output token "
                           "in seconds (vLLM's older name of inter_token_latency).", buckets=_VLLM_ITL_BUCKETS)
        self.e2e = metric(Histogram, "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in "
                          "seconds.", buckets=_VLLM_LATENCY_BUCKETS)
        self.queue_time = metric(Histogram, "vllm:request_queue_time_seconds", "Histogram of time spent in "
                                 "WAITING phase for request.", buckets=_VLLM_LATENCY_BUCKETS)
        self.request_prompt_tokens = metric(Histogram, "vllm:request_prompt_tokens", "Number of prefill tokens "
                                            "processed.", buckets=token_buckets(max_model_len))
        self.request_generation_tokens = metric(Histogram, "vllm:request_generation_tokens", "Number of "
                                                "generation tokens processed.", buckets=token_buckets(max_model_len))
        self._model_name = model_name
        self._totals = (0, 0, 0)  # preemptions, prefix queries, prefix hits as last reported

    def on_stats(self, s: EngineStats) -> None:
        self.num_running.set(s.num_running)
        self.num_waiting.set(s.num_waiting)
        usage = 1 - s.num_free_kv_blocks / s.num_kv_blocks if s.num_kv_blocks else 0.0
        self.kv_usage.set(usage)
        self.gpu_cache_usage.set(usage)
        totals = (s.num_preemptions, s.num_prefix_cache_queries, s.num_prefix_cache_hits)
        counters = (self.preemptions, self.prefix_queries, self.prefix_hits)
        for counter, before, now in zip(counters, self._totals, totals):
            counter.inc(max(0, now - before))
        self._totals = tuple(max(a, b) for a, b in zip(self._totals, totals))

    def on_finished(self, finish_reason: str, timings: RequestTimings | None) -> None:
        self._success.labels(self._model_name, finish_reason).inc()
        if timings is None:  # aborted by the frontend: the engine reported nothing
            return
        if timings.ttft_s is not None:
            self.ttft.observe(timings.ttft_s)
        if timings.queue_s is not None:
            self.queue_time.observe(timings.queue_s)
        self.e2e.observe(timings.e2e_s)
        for gap in timings.tbt_s:
            self.itl.observe(gap)
            self.tpot.observe(gap)
        self.request_prompt_tokens.observe(timings.num_prompt_tokens)
        self.request_generation_tokens.observe(timings.num_output_tokens)
