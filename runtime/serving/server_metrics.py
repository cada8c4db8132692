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
"""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pipeserve.parallel.wire import EngineStats, RequestTimings
from pipeserve.runtime.bench.metrics import BubbleWindow

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TBT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_RATE_WINDOW_S = 5.0
_BUBBLE_WINDOW_S = 10.0


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
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

    def on_tokens(self, num_tokens: int) -> None:
        self._generated += num_tokens
        self.generation_tokens.inc(num_tokens)

    def on_finished(self, finish_reason: str, timings: RequestTimings | None) -> None:
        self._finished.labels(self._model_name, finish_reason).inc()
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
