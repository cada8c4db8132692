"""A pipeserve worker: one torchrun process, one device, one (stage, TP rank) of the model.

    torchrun --nproc-per-node N -m pipeserve.runtime.worker.worker     (the engine starts this)

Every worker receives every StepPlan (ZeroMQ); stage 0 embeds the plan's tokens, later stages
receive the previous stage's hidden states (NCCL / gloo point-to-point, shape [T, H] derived
from the plan); the last stage's TP rank 0 samples and sends the StepResult. With token
feedback it also sends the sampled ids to stage 0, which feeds them to later plans' decodes.
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
import traceback
from collections import deque

import torch
import torch.distributed as dist

from pipeserve.parallel.context import ParallelContext, build_parallel_context, stage_ranks
from pipeserve.parallel.feedback import FeedbackReceiver, FeedbackSender, warm_up
from pipeserve.parallel.split_head import split_rows
from pipeserve.parallel.stage_plan import plan_model_stages
from pipeserve.parallel.transport import TransportConfig, WorkerChannel
from pipeserve.parallel.wire import BlockTableMirror, PostFeedback, Shutdown, StepPlan, StepResult, WorkerError
from pipeserve.runtime.worker.batch import ModelInputs, StepInputs, to_tensors
from pipeserve.runtime.config import EngineConfig, engine_config_from_dict
from pipeserve.runtime.worker.cuda_graphs import GraphStep, capture_cuda_graphs
from pipeserve.runtime.engine.executor import spec_to_params
from pipeserve.runtime.worker.kv_cache import allocate_kv_cache, kv_cache_bytes_per_block
from pipeserve.runtime.model.loader import load_model, read_config_and_tokenizer, set_kernels
from pipeserve.runtime.worker.sampler import Sampler, make_generator

EXIT_ENGINE_LOST = 3
PROFILE_ENV = "PIPESERVE_WORKER_PROFILE"
"""A folder: each worker profiles its ``execute`` calls (cProfile) and writes the functions with
the most own and cumulative time there at shutdown (``worker_rank{R}.txt``). Diagnostics only:
cProfile slows the host."""
_IDLE_POST_S = 0.005
"""A first-stage rank that has waited this long for a plan posts its feedback receives still
held back (parallel/feedback.py): sooner would put them beside the next plan's compute."""
_REMOTE_RESULT_POLL_S = 0.0001
"""How often the driver looks for a split step's ids while it has no plan to run: they come back
from the first stage, so waiting for them would keep a plan that arrives meanwhile waiting."""
_IDLE_POST_SPLIT_S = 0.05
"""The same when only split steps' receives are held back: the engine asks for those when it
waits for one (``PostFeedback``), so this is a safety net, longer than the host's usual lead."""


class Worker:
    def __init__(self, config: EngineConfig, ctx: ParallelContext, device: torch.device) -> None:
        self.config, self.ctx, self.device = config, ctx, device
        self.dtype = config.torch_dtype(device)
        model_config, _, _ = read_config_and_tokenizer(config.model)
        par = config.parallel
        span = plan_model_stages(model_config, ctx.pp_size, override=par.stage_layers,
                                 half_layers=par.half_layer_stages)[ctx.stage]
        # Split sampling (parallel/split_head.py): the first stage holds the head's rows [0, V0).
        split = config.split_sampling and ctx.feedback_group is not None
        head_rows = split_rows(model_config.vocab_size) if split else 0
        loaded = load_model(config.model, dtype=self.dtype, device=device, start_layer=span.start_layer,
                            end_layer=span.end_layer, load_format=config.load_format, parallel=ctx,
                            head_rows=head_rows if ctx.is_first_stage else 0, first_mlp_only=span.first_mlp_only,
                            last_attention_only=span.last_attention_only)
        self.model, self.model_config = loaded.model, loaded.config
        set_kernels(self.model, config, device)
        self.eos_token_ids = tuple(loaded.config.eos_token_ids) or tuple(loaded.tokenizer.eos_token_ids)
        self.num_layers = span.num_layers  # (reported in the stage timeline; a half counts half)
        self.num_kv_layers = span.num_attention_layers
        self.num_kv_blocks = self._agree_on_kv_blocks()
        self.kv_caches = allocate_kv_cache(
            self.model_config, num_layers=self.num_kv_layers, num_blocks=self.num_kv_blocks,
            block_size=config.block_size, dtype=self.dtype, device=device,
            num_kv_heads=self.model.num_local_kv_heads,
        )
        # Every TP rank of the stage captures the same buckets in the same order (NCCL inside).
        max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        self.cuda_graphs = None
        if config.cuda_graphs_in_workers and not config.deterministic:  # (see cuda_graphs.py)
            self.cuda_graphs = capture_cuda_graphs(self.model, self.kv_caches, config,
                                                   max_model_len=max_model_len, device=device)
        self.mirror = BlockTableMirror()
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator | None] = {}
        self._params: dict[str, tuple[object, object]] = {}  # rid -> (spec, SamplingParams)
        self._pending_send: tuple[dist.Work, torch.Tensor] | None = None
        # The busy total is always kept (/metrics); per-step spans only when asked (benchmarks).
        stats = os.environ.get("PIPESERVE_STAGE_STATS") or os.environ.get("PIPESERVE_STAGE_STATS_DIR")
        self.busy = BusyTimer(device, record=bool(stats))
        self.feedback_sender: FeedbackSender | None = None
        self.feedback_receiver: FeedbackReceiver | None = None
        if (group := ctx.feedback_group) is not None:
            # Each receive is posted pp - 1 plans after its plan, whatever parallel.decode_groups
            # (parallel/feedback.py): a fed decode comes pp or more plans after.
            first = stage_ranks(0, ctx.tp_size)
            warm_up(group, src=ctx.driver_rank, dsts=first, rank=ctx.rank, device=device)
            if ctx.is_driver:
                head = (self.model.lm_head.weight[head_rows:], head_rows) if split else None
                self.feedback_sender = FeedbackSender(group, first, pp=ctx.pp_size, split=head)
            else:
                self.feedback_receiver = FeedbackReceiver(group, ctx.driver_rank, device, post_lag=ctx.pp_size - 1,
                                                          split_weight=self.model.head_share_weight)
        # A split step's ids come back from the first stage: a side stream waits for them, so
        # that this stage's next micro-batch does not.
        self._result_stream = torch.cuda.Stream(device) if split and device.type == "cuda" else None

    def _agree_on_kv_blocks(self) -> int:
        """Every stage holds the same number of blocks: the fewest any rank can afford."""
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        per_block = kv_cache_bytes_per_block(
            self.model_config, num_layers=self.num_kv_layers, block_size=self.config.block_size,
            dtype=self.dtype, num_kv_heads=self.model.num_local_kv_heads,
        )
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = total * self.config.gpu_memory_utilization - (total - free) - (2 << 30)
        else:
            budget = self.config.kv_cache_memory_gb * 2**30
        mine = torch.tensor([max(int(budget // per_block), 1)], device=self.device)
        dist.all_reduce(mine, op=dist.ReduceOp.MIN)
        return int(mine.item())

    # ---- one micro-batch ---------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult | _PendingResult | None:
        for rid in plan.freed:
            self._generators.pop(rid, None)
            self._params.pop(rid, None)
        tables = self.mirror.apply_plan(plan)
        receiver = self.feedback_receiver
        feed = None if receiver is None else receiver.take(plan)
        step = StepInputs(
            request_ids=[s.request_id for s in plan.seqs],
            token_ids=_token_ids(plan, can_feed=receiver is not None or not self.ctx.is_first_stage),
            query_lens=[s.num_scheduled_tokens for s in plan.seqs],
            start_positions=[s.num_computed_tokens for s in plan.seqs],
            block_tables=tables,
            needs_sample=[s.needs_sample for s in plan.seqs],
        )
        t0 = time.perf_counter()
        inputs = self._prepare(step)
        hidden_in = None
        if not self.ctx.is_first_stage:
            self.busy.begin_recv()
            hidden_in = self._recv(step.num_tokens)
        self.busy.begin(graph=isinstance(inputs, GraphStep))
        hidden = self._forward(inputs, hidden_in, feed)
        if not self.ctx.is_last_stage:
            self.busy.end(plan.step_id)
            self._send(hidden)
            if self.feedback_receiver is not None:
                self.feedback_receiver.post_due()  # sampled ids due, from the driver (feedback.py)
            return None
        rows = hidden[inputs.sample_indices]
        sender = self.feedback_sender
        if sender is not None and sender.splits(plan):
            return self._sample_split(plan, rows, time.perf_counter() - t0)  # (ends the busy span)
        logits = self.model.compute_logits(rows)
        if not self.ctx.is_driver:
            self.busy.end(plan.step_id)
            return None
        return self._sample(plan, logits, time.perf_counter() - t0)  # (ends the busy span)

    def _prepare(self, step: StepInputs) -> GraphStep | ModelInputs:
        """Host-side inputs: a padded graph step when a captured bucket holds the step (decode
        or mixed, ``CudaGraphRunner.prepare``), else the packed tensors of an eager forward."""
        if self.cuda_graphs is not None and (g := self.cuda_graphs.prepare(step)) is not None:
            return g
        return to_tensors(step, block_size=self.config.block_size, device=self.device)

    def _forward(self, inputs: GraphStep | ModelInputs, hidden_in: torch.Tensor | None, feed) -> torch.Tensor:
        """``feed``: the fed decode tokens' patch of the input ids (stage 0, token feedback)."""
        if isinstance(inputs, GraphStep):
            hidden = self.cuda_graphs.replay(inputs, hidden_in, feed)
            # The graph's output buffer is rewritten by the next replay while an isend (on
            # NCCL's stream) may still read it: send a copy.
            return hidden if self.ctx.is_last_stage else hidden.clone()
        if feed is not None:
            feed(inputs.input_ids)
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta,
                          hidden_states=hidden_in)

    def _recv(self, num_tokens: int) -> torch.Tensor:
        # The shape comes from the plan: no shape message travels.
        buf = torch.empty(num_tokens, self.model_config.hidden_size, dtype=self.dtype, device=self.device)
        dist.recv(buf, src=self.ctx.prev_rank)
        return buf

    def _send(self, hidden: torch.Tensor) -> None:
        self.wait_sends()  # the previous micro-batch's buffer must stay alive until sent
        hidden = hidden.contiguous()
        self._pending_send = (dist.isend(hidden, dst=self.ctx.next_rank), hidden)

    def wait_sends(self) -> None:
        if self._pending_send is not None:
            self._pending_send[0].wait()
            self._pending_send = None

    def _sample(self, plan: StepPlan, logits: torch.Tensor, seconds: float) -> StepResult | _PendingResult:
        seqs = [s for s in plan.seqs if s.needs_sample]
        params = [self._params_of(s) for s in seqs]
        gens = [self._generator_of(s, p) for s, p in zip(seqs, params)]
        sender = self.feedback_sender

        def on_sampled(token_ids: torch.Tensor) -> None:
            # Sampling is this stage's work too: the span ends once the ids exist on the device.
            self.busy.end(plan.step_id)
            if sender is not None:
                sender.send(token_ids)

        # With token feedback nothing waits for this result on the critical path: leave the ids
        # on the device and go on to the next plan; serve() sends the result once they are here.
        defer = sender is not None and self.device.type == "cuda"
        out = self.sampler(logits, params, gens, num_output_tokens=[s.num_output_tokens for s in seqs],
                           eos_token_ids=self.eos_token_ids, on_sampled=on_sampled, to_host=not defer)
        if out.token_ids.device.type != "cpu":
            return _PendingResult(plan.step_id, [s.request_id for s in seqs], out.token_ids, seconds)
        logprobs = None
        if out.logprobs is not None and any(lp is not None for lp in out.logprobs):
            logprobs = [lp or {} for lp in out.logprobs]
        return StepResult(step_id=plan.step_id, request_ids=[s.request_id for s in seqs],
                          token_ids=out.token_ids.tolist(), logprobs=logprobs, stage_times=[seconds])

    def _sample_split(self, plan: StepPlan, rows: torch.Tensor, seconds: float) -> StepResult | _PendingResult:
        """A split step (parallel/split_head.py): this stage's share of the head goes to the first
        stage, whose combined ids come back; on CUDA nothing here waits for them."""
        token_ids, arrival = self.feedback_sender.send_split(rows)
        self.busy.end(plan.step_id)  # this stage's work on the step is queued
        request_ids = [s.request_id for s in plan.seqs if s.needs_sample]
        if self._result_stream is not None:
            return _PendingResult(plan.step_id, request_ids, token_ids, seconds, after=arrival,
                                  stream=self._result_stream)
        arrival.wait()
        return StepResult(step_id=plan.step_id, request_ids=request_ids, token_ids=token_ids.tolist(),
                          stage_times=[seconds])

    def _params_of(self, seq):
        cached = self._params.get(seq.request_id)
        if cached is None or cached[0] != seq.sampling:
            cached = (seq.sampling, spec_to_params(seq.sampling))
            self._params[seq.request_id] = cached
        return cached[1]

    def _generator_of(self, seq, params) -> torch.Generator | None:
        if seq.request_id not in self._generators:
            self._generators[seq.request_id] = make_generator(params.seed, self.device)
        return self._generators[seq.request_id]

    def _write_stage_timeline(self, out_dir: str) -> None:
        """Benchmarks: this rank's per-step timeline as JSON, read by the bench after shutdown."""
        os.makedirs(out_dir, exist_ok=True)
        split = [end.num_split for end in (self.feedback_sender, self.feedback_receiver) if end is not None]
        data = dict(rank=self.ctx.rank, stage=self.ctx.stage, tp_rank=self.ctx.tp_rank,
                    num_layers=self.num_layers, spans=self.busy.timeline(),
                    host={**self.busy.host_summary(), "split_steps": sum(split)})
        with open(os.path.join(out_dir, f"stage_rank{self.ctx.rank}.json"), "w") as f:
            json.dump(data, f)

    # ---- the loop ----------------------------------------------------------------------------

    def serve(self, channel: WorkerChannel) -> None:
        """Runs plans in order until Shutdown; exits if the engine goes silent. Results whose
        ids are still on their way from the device (``_PendingResult``) go out as soon as they
        are here, and before this rank waits for a plan (the engine matches results by step)."""
        pending: deque[_PendingResult | StepResult] = deque()  # in step order
        receiver = self.feedback_receiver
        profile_dir = os.environ.get(PROFILE_ENV)
        profiler = cProfile.Profile() if profile_dir else None
        while True:
            timeout = 1.0
            if pending:  # (a split step's ids come back from the first stage: poll, do not block)
                timeout = _REMOTE_RESULT_POLL_S if _awaits_remote(pending[0]) else 0.0
            if receiver is not None and receiver.unposted:
                timeout = min(timeout, _IDLE_POST_SPLIT_S if receiver.unposted_split_only else _IDLE_POST_S)
            msg = channel.recv_plan(timeout_s=timeout)
            if msg is None:
                if receiver is not None and receiver.unposted:
                    receiver.post()  # no plan to wait beside any more (feedback.py)
                if pending and not _awaits_remote(pending[0]):
                    channel.send(_arrived(pending.popleft()))
                    continue
                if not channel.engine_alive():
                    raise SystemExit(EXIT_ENGINE_LOST)
                self.busy.poll()  # idle: the last steps' busy time reaches the heartbeat
                continue
            if isinstance(msg, PostFeedback):
                if receiver is not None:
                    receiver.post()  # the engine waits for a split step's ids (wire.PostFeedback)
                continue
            if isinstance(msg, Shutdown) or msg.shutdown:
                while pending:
                    channel.send(_arrived(pending.popleft()))
                self.wait_sends()
                for end in (self.feedback_sender, self.feedback_receiver):
                    if end is not None:
                        end.close()
                if os.environ.get("PIPESERVE_STAGE_STATS"):
                    stats = dict(rank=self.ctx.rank, stage=self.ctx.stage, **self.busy.summary())
                    print("STAGE_STATS " + json.dumps(stats), flush=True)
                if out_dir := os.environ.get("PIPESERVE_STAGE_STATS_DIR"):
                    self._write_stage_timeline(out_dir)
                if profiler is not None:
                    _write_profile(profiler, profile_dir, self.ctx.rank)
                return
            if profiler is not None:
                profiler.enable()
            result = self.execute(msg)
            if profiler is not None:
                profiler.disable()
            if result is not None:
                pending.append(result)
            while pending and (isinstance(pending[0], StepResult) or pending[0].ready()):
                channel.send(_arrived(pending.popleft()))


def _write_profile(profiler: cProfile.Profile, folder: str, rank: int, top: int = 40) -> None:
    os.makedirs(folder, exist_ok=True)
    out = io.StringIO()
    for key in ("tottime", "cumulative"):
        pstats.Stats(profiler, stream=out).sort_stats(key).print_stats(top)
    with open(os.path.join(folder, f"worker_rank{rank}.txt"), "w") as f:
        f.write(out.getvalue())


class _PendingResult:
    """A step's sampled ids on their way to pinned host memory (the driver, token feedback)."""

    def __init__(self, step_id: int, request_ids: list[str], token_ids: torch.Tensor, seconds: float, *,
                 after: dist.Work | None = None, stream: torch.cuda.Stream | None = None) -> None:
        """``after``: a receive the ids come in by; ``stream``: where the copy waits for it
        (default the current stream)."""
        self.step_id, self.request_ids, self.seconds = step_id, request_ids, seconds
        self.remote = after is not None  # the ids come from another rank
        self.host = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
        self.event = torch.cuda.Event()
        self.token_ids = token_ids  # alive until copied (it may live on another stream)
        with torch.cuda.stream(stream if stream is not None else torch.cuda.current_stream()):
            if after is not None:
                after.wait()
            self.host.copy_(token_ids, non_blocking=True)
            self.event.record()

    def ready(self) -> bool:
        return self.event.query()

    def result(self) -> StepResult:
        self.event.synchronize()
        return StepResult(step_id=self.step_id, request_ids=self.request_ids, token_ids=self.host.tolist(),
                          stage_times=[self.seconds])


def _awaits_remote(item: _PendingResult | StepResult) -> bool:
    """A split step's result whose ids have not come back from the first stage yet."""
    return isinstance(item, _PendingResult) and item.remote and not item.ready()


def _arrived(item: _PendingResult | StepResult) -> StepResult:
    """The result to send, once its ids are on the host."""
    return item.result() if isinstance(item, _PendingResult) else item


class BusyTimer:
    """Compute time of this rank's micro-batches (after the input arrived, until the output is
    ready: the hidden states, or on the last stage's driver the sampled ids), with no
    synchronize on the hot path.

    ``busy_s`` (always kept) is the running total, which the heartbeat thread reports for
    /metrics: on CPU the host time of each step; on CUDA a pair of events per step, added once
    the end event has completed (``poll``, non-blocking), so the total trails the device by the
    steps still queued. Only aggregates stay, so a long-running server does not grow.

    With ``record`` (benchmarks) every span is kept too, with the step id and when the rank
    began waiting for its input (``begin_recv``), so ``timeline`` can give per-step (recv
    wait, compute) times on the host clock (time.monotonic, shared by every process of a host).
    That list grows with every step."""

    _MAX_PENDING = 64
    """Unread CUDA steps before ``poll`` waits for the oldest (which ended long ago)."""

    def __init__(self, device: torch.device, *, record: bool) -> None:
        self.record = record
        self.cuda = device.type == "cuda"
        self.busy_s = 0.0
        self.num_steps = 0
        self._pending: deque = deque()  # CUDA: (start, end) events not yet in busy_s
        self.spans: list = []  # record: (start, end) marks
        # record, per span: (step id, recv-start mark, CUDA graph?, host instants of begin and end)
        self.steps: list[tuple[int, object, bool, float, float]] = []
        self._launch: tuple[bool, float] = (False, 0.0)  # (CUDA graph?, host instant of begin)
        self._start = None
        self._recv_start = None
        self._ref = None  # CUDA record: (event, host time) of one synchronized instant

    def _mark(self):
        if self.cuda:
            if self.record and self._ref is None:  # once, before the first step: anchors the
                # events to the host clock for timeline()
                torch.cuda.synchronize()
                ref = torch.cuda.Event(enable_timing=True)
                ref.record()
                torch.cuda.synchronize()
                self._ref = (ref, time.monotonic())
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.monotonic()

    def begin_recv(self) -> None:
        if self.record:
            self._recv_start = self._mark()

    def begin(self, *, graph: bool = False) -> None:
        """``graph``: the step replays a CUDA graph (else its kernels launch one by one)."""
        self._start = self._mark()
        if self.record:
            self._launch = (graph, time.monotonic())

    def end(self, step_id: int = -1) -> None:
        span = (self._start, self._mark())
        self.num_steps += 1
        if self.cuda:
            self._pending.append(span)
            self.poll()
        else:
            self.busy_s += span[1] - span[0]
        if self.record:
            self.spans.append(span)
            recv = self._recv_start if self._recv_start is not None else self._start
            self.steps.append((step_id, recv, *self._launch, time.monotonic()))
            self._recv_start = None

    def poll(self) -> None:
        """CUDA: adds the steps whose end event has completed to ``busy_s``."""
        while self._pending:
            start, end = self._pending[0]
            if len(self._pending) > self._MAX_PENDING:
                end.synchronize()
            elif not end.query():
                return
            self._pending.popleft()
            self.busy_s += start.elapsed_time(end) / 1e3

    def timeline(self) -> list[list[float]]:
        """[step id, recv start, compute start, compute end, queued] per micro-batch, host
        seconds; queued = when the host had queued the step's work (``end`` was called)."""
        if self.cuda and self.spans:
            torch.cuda.synchronize()
            ref, host = self._ref
            to_host = lambda ev: host + ref.elapsed_time(ev) / 1e3  # noqa: E731
        else:
            to_host = float
        return [[step, to_host(recv), to_host(a), to_host(b), queued]
                for (step, recv, _, _, queued), (a, b) in zip(self.steps, self.spans)]

    def host_summary(self) -> dict:
        """Record mode: the host's median milliseconds from a step's begin to its end call
        (launching its forward, and on the driver its sampling) for eager and CUDA graph
        steps; on CUDA also the caching allocator's device calls and retries (a retry frees
        cached blocks, which synchronizes the device: the host then waits for earlier work)."""
        out: dict = {}
        for name, graph in (("eager", False), ("graph", True)):
            ms = [(q - t) * 1e3 for _, _, g, t, q in self.steps if g == graph]
            out[name] = {"n": len(ms), "launch_ms_p50": statistics.median(ms) if ms else None,
                         "launch_ms_p90": statistics.quantiles(ms, n=10)[-1] if len(ms) > 1 else None}
        if self.cuda:
            stats = torch.cuda.memory_stats()
            out["allocator"] = {k: stats.get(k, 0) for k in ("num_alloc_retries", "num_device_alloc",
                                                              "num_device_free", "num_sync_all_streams")}
        return out

    def summary(self) -> dict:
        """Record mode: busy_s: summed compute; wall_s: first start to last end; busy_fraction."""
        if not self.spans:
            return {"busy_s": 0.0, "wall_s": 0.0, "busy_fraction": 0.0, "num_steps": 0}
        if self.cuda:
            torch.cuda.synchronize()
            busy = sum(a.elapsed_time(b) for a, b in self.spans) / 1e3
            wall = self.spans[0][0].elapsed_time(self.spans[-1][1]) / 1e3
        else:
            busy = sum(b - a for a, b in self.spans)
            wall = self.spans[-1][1] - self.spans[0][0]
        return {"busy_s": busy, "wall_s": wall, "busy_fraction": busy / wall if wall else 0.0,
                "num_steps": len(self.spans)}


def _token_ids(plan: StepPlan, *, can_feed: bool) -> list[int]:
    """The plan's packed input tokens; a fed decode's is a placeholder 0 until stage 0's patch
    (``can_feed``: this rank has one, or does not embed)."""
    ids: list[int] = []
    for s in plan.seqs:
        ids += s.new_token_ids
        if s.feed_step >= 0:
            if not can_feed:
                raise RuntimeError("a plan feeds a decode but this worker runs without token feedback "
                                   "(parallel.token_feedback differs between the engine and the workers)")
            ids.append(0)
    return ids


def _device(config: EngineConfig, local_rank: int) -> torch.device:
    if config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def main() -> None:
    config = engine_config_from_dict(json.loads(os.environ["PIPESERVE_ENGINE_CONFIG"]))
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    device = _device(config, local_rank)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    ctx = build_parallel_context(config.parallel.tp, config.parallel.pp, token_feedback=config.parallel.feedback,
                                 feedback_max_ctas=config.parallel.feedback_max_ctas)
    transport = TransportConfig(liveness_timeout_s=config.parallel.liveness_timeout_s,
                                handshake_timeout_s=600.0)
    channel = None
    try:
        torch.manual_seed(config.seed)
        worker = Worker(config, ctx, device)
        channel = WorkerChannel(
            transport, rank=rank, world_size=ctx.world_size, stage=ctx.stage, tp_rank=ctx.tp_rank,
            plan_endpoint=os.environ["PIPESERVE_PLAN_ENDPOINT"],
            result_endpoint=os.environ["PIPESERVE_RESULT_ENDPOINT"],
            # A worker blocked in a collective cannot poll: leave from the heartbeat thread.
            on_engine_lost=lambda: os._exit(EXIT_ENGINE_LOST),
            num_kv_blocks=worker.num_kv_blocks,
            # Each stage's TP rank 0 reports the stage's busy time on its heartbeats.
            busy_s=(lambda: worker.busy.busy_s) if ctx.tp_rank == 0 else None,
        )
        channel.handshake()
        worker.serve(channel)
    except Exception as e:
        if channel is not None:
            channel.send(WorkerError(rank=rank, message=f"{type(e).__name__}: {e}"))
        traceback.print_exc()
        sys.exit(1)
    finally:
        if channel is not None:
            channel.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
