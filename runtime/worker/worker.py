"""A pipeserve worker: one device, one (stage, TP rank) of the model.

    torchrun --nproc-per-node N -m pipeserve.runtime.worker.worker     (the engine starts this)

One GPU is a group of one: the engine drives the same ``Worker`` in its own process
(``executor.InProcessExecutor``), so model loading, KV sizing, CUDA graphs and sampling exist
once. Under torchrun every worker receives every StepPlan (ZeroMQ); stage 0 embeds the plan's
tokens, later stages receive the previous stage's hidden states (NCCL / gloo point-to-point,
shape [T, H] derived from the plan); the last stage's TP rank 0 samples and sends the
StepResult. With token feedback it also sends the sampled ids to stage 0, which feeds them to
later plans' decodes.
"""

from __future__ import annotations

import cProfile
import dataclasses
import functools
import io
import json
import math
import os
import pstats
import signal
import statistics
import sys
import time
import traceback
from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist

from pipeserve.parallel.auth import KEY_ENV, KEY_FILE_ENV, RunKey, remove_key_file
from pipeserve.parallel.context import ParallelContext, build_parallel_context, stage_ranks
from pipeserve.parallel.feedback import FeedbackReceiver, FeedbackSender, warm_up
from pipeserve.parallel.stage_plan import plan_model_stages
from pipeserve.parallel.symmetric import SymmetricAllReduce
from pipeserve.parallel.transport import EngineShutdown, LauncherGone, TransportConfig, WorkerChannel
from pipeserve.parallel.wire import PromptLogprobs, Shutdown, StepPlan, StepResult, WorkerError
from pipeserve.runtime import progress
from pipeserve.runtime.heap import CollectionPauses, freeze_start_up_heap, thaw_heap
from pipeserve.runtime.config import EngineConfig, engine_config_from_dict
from pipeserve.runtime.model.loader import LoadedModel, load_model, read_config_and_tokenizer, set_kernels
from pipeserve.runtime.worker.batch import PlanInputs, StepInputs, to_tensors
from pipeserve.runtime.worker.cuda_graphs import GraphStep, capture_cuda_graphs
from pipeserve.runtime.worker.kv_cache import allocate_kv_cache, kv_cache_bytes_per_block
from pipeserve.runtime.worker.model_runner import ModelRunner
from pipeserve.runtime.worker.rendezvous import broadcast_json, gather_timelines
from pipeserve.runtime.worker.grammar import GrammarCompiler, GrammarState, TokenBitmask
from pipeserve.runtime.worker.penalties import TokenHistory
from pipeserve.runtime.worker.prompt_logprobs import (
    PromptRows,
    compute_prompt_logprobs,
    prompt_logprobs_of,
    prompt_rows,
)
from pipeserve.runtime.worker.sampler import Sampler, make_generator, race_inputs, takes_argmax, takes_race
from pipeserve.scheduler import SamplingParams

EXIT_ENGINE_LOST = 3
STAGE_STATS_DIR_ENV = "PIPESERVE_STAGE_STATS_DIR"
"""Benchmarks: a folder where the workers' stage timelines land after the run (rank 0 writes
every rank's), and the switch that makes the workers record them."""
IGNORE_SIGTERM_ENV = "PIPESERVE_WORKER_IGNORE_SIGTERM"
"""Set by an engine that starts its rank-0 worker under an outer torchrun: that worker leaves
when the engine tells it to (or goes silent), never on a job's SIGTERM."""
PROFILE_ENV = "PIPESERVE_WORKER_PROFILE"
"""A folder: each worker profiles its ``execute`` calls (cProfile) and writes the functions with
the most own and cumulative time there at shutdown (``worker_rank{R}.txt``). Diagnostics only:
cProfile slows the host."""
_IDLE_POST_S = 0.005
"""A first-stage rank that has waited this long for a plan posts its feedback receives still
held back (parallel/feedback.py): sooner would put them beside the next plan's compute."""


class Worker:
    def __init__(self, config: EngineConfig, ctx: ParallelContext, device: torch.device, *,
                 loaded: LoadedModel | None = None, record: bool | None = None) -> None:
        """``loaded``: a whole model already in memory (a group of one; sweeps and tests build
        several engines over one model). ``record``: keep every step's span for a benchmark's
        stage timeline (None: when ``PIPESERVE_STAGE_STATS`` or ``PIPESERVE_STAGE_STATS_DIR``
        is set)."""
        start = time.perf_counter()
        self.config, self.ctx, self.device = config, ctx, device
        self.dtype = config.torch_dtype(device)
        if loaded is None:
            self.ctx = ctx = self._with_symmetric_sums(ctx)
            loaded = self._load()
        assert loaded.model.start_layer == 0 or ctx.pp_size > 1
        self.model, self.model_config, self.tokenizer = loaded.model, loaded.config, loaded.tokenizer
        set_kernels(self.model, config, device)
        self.eos_token_ids = tuple(loaded.config.eos_token_ids) or tuple(loaded.tokenizer.eos_token_ids)
        self.sampler = Sampler()
        # Temperature-only steps race over the vocab shards (kernels/race.py) where that spares
        # gathering the logits for the driver's sampler: at tp > 1 (decode-heavy tp=2 +4.2% on
        # 2 × H200); on one GPU it was not measured to help, and the sampler keeps those rows.
        self._races = ctx.tp_size > 1 and self.model.ops.race_max is not None
        self.num_kv_blocks = self._agree_on_kv_blocks()
        kv_caches = allocate_kv_cache(
            self.model_config, num_layers=self.model.num_layers, num_blocks=self.num_kv_blocks,
            block_size=config.block_size, dtype=self.dtype, device=device,
            num_kv_heads=self.model.num_local_kv_heads,
        )
        progress.info("KV cache: %d blocks of %d tokens (%.2f GiB%s)", self.num_kv_blocks, config.block_size,
                      sum(t.nbytes for t in kv_caches) / 2**30, " on rank 0" if ctx.world_size > 1 else "")
        # Every TP rank of the stage captures the same buckets in the same order (NCCL inside).
        graphs = None
        if self._captures_graphs:
            graphs = capture_cuda_graphs(self.model, kv_caches, config, max_model_len=self._max_model_len,
                                         device=device)
        self.runner = ModelRunner(self.model, kv_caches=kv_caches, block_size=config.block_size, device=device,
                                  cuda_graphs=graphs)
        self.plans = PlanInputs()
        self._generators: dict[str, torch.Generator | None] = {}
        self._history = TokenHistory(device)  # the driver's: tokens that penalties and bad words read
        self._grammars: GrammarState | None = None  # the driver's structured-output matchers, once one comes
        self._pending_send: tuple[dist.Work, torch.Tensor] | None = None
        # The busy total is always kept (/metrics); per-step spans only when asked (benchmarks).
        if record is None:
            record = bool(os.environ.get("PIPESERVE_STAGE_STATS") or os.environ.get(STAGE_STATS_DIR_ENV))
        self.busy = BusyTimer(device, record=record)
        self.feedback_sender: FeedbackSender | None = None
        self.feedback_receiver: FeedbackReceiver | None = None
        if config.parallel.feedback:
            # The driver sends each step's sampled ids to the first stage's other ranks; at pp=1
            # it is one of them and hands its own over in this process (parallel/feedback.py).
            others = [r for r in stage_ranks(0, ctx.tp_size) if r != ctx.driver_rank]
            if (group := ctx.feedback_group) is not None:
                warm_up(group, src=ctx.driver_rank, dsts=others, rank=ctx.rank, device=device)
            if ctx.is_driver:
                local = FeedbackReceiver(None, None, device, post_lag=0) if ctx.is_first_stage else None
                self.feedback_sender = FeedbackSender(group, others, pp=ctx.pp_size, local=local)
                self.feedback_receiver = local
            elif ctx.is_first_stage:
                self.feedback_receiver = FeedbackReceiver(group, ctx.driver_rank, device, post_lag=ctx.pp_size - 1)
        progress.info("ready in %.1f s", time.perf_counter() - start)

    def _with_symmetric_sums(self, ctx: ParallelContext) -> ParallelContext:
        """TP on CUDA: the forward's sums through symmetric memory (``parallel/symmetric.py``),
        sized for the largest micro-batch. Deterministic mode keeps its own sums."""
        if ctx.tp_size == 1 or self.device.type != "cuda" or self.config.deterministic:
            return ctx
        model_config, _, _ = read_config_and_tokenizer(self.config.model)
        reduce = SymmetricAllReduce.create(
            ctx.tp_group, max_numel=self.config.scheduler.max_num_batched_tokens * model_config.hidden_size,
            dtype=self.dtype, device=self.device)
        return dataclasses.replace(ctx, tp_reduce=reduce)

    def _load(self) -> LoadedModel:
        """This rank's slice of the checkpoint: its stage's layers, its TP shard."""
        par = self.config.parallel
        span = None
        if self.ctx.pp_size > 1:
            model_config, _, _ = read_config_and_tokenizer(self.config.model)
            span = plan_model_stages(model_config, self.ctx.pp_size, override=par.stage_layers)[self.ctx.stage]
        return load_model(
            self.config.model, dtype=self.dtype, device=self.device, load_format=self.config.load_format,
            quantization=self.config.quantization, parallel=self.ctx, start_layer=0 if span is None else span.start_layer,
            end_layer=None if span is None else span.end_layer,
        )

    @property
    def _max_model_len(self) -> int:
        return self.config.max_model_len or self.model_config.max_position_embeddings

    @property
    def _max_logit_rows(self) -> int:
        """Rows of logits the largest micro-batch samples: what ``_profile_forward`` measures,
        and the slice of prompt rows the LM head takes at once (``prompt_logprobs.py``)."""
        sched = self.config.scheduler
        num_tokens = sched.max_num_batched_tokens
        return max(min(sched.max_num_seqs, num_tokens), math.ceil(num_tokens / self._max_model_len))

    @property
    def _captures_graphs(self) -> bool:
        # Deterministic mode keeps tp/pp workers eager (cuda_graphs.py).
        return not (self.config.deterministic and self.ctx.world_size > 1)

    # ---- the KV pool -------------------------------------------------------------------------

    def _agree_on_kv_blocks(self) -> int:
        """Every stage holds the same number of blocks: the fewest any rank can afford."""
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        per_block = kv_cache_bytes_per_block(
            self.model_config, num_layers=self.model.num_layers, block_size=self.config.block_size,
            dtype=self.dtype, num_kv_heads=self.model.num_local_kv_heads,
        )
        mine = torch.tensor([max(int(self._kv_cache_budget() // per_block), 0)], device=self.device)
        if self.ctx.world_size > 1:
            dist.all_reduce(mine, op=dist.ReduceOp.MIN)
        num_blocks = int(mine.item())
        if num_blocks < 1:
            raise ValueError("no memory left for the KV cache: lower scheduler.max_num_batched_tokens, raise "
                             "engine.gpu_memory_utilization, or use more GPUs")
        return num_blocks

    def _kv_cache_budget(self) -> float:
        """Bytes this rank can give the KV pool. On CUDA: ``gpu_memory_utilization`` of the card,
        less what is in use now (weights, CUDA and NCCL context, other processes), less the peak
        one forward of the largest micro-batch allocates (measured, ``_profile_forward``), and as
        much again for the CUDA graphs' pool (which holds one forward of the largest bucket).
        On CPU: ``kv_cache_memory_gb``."""
        if self.device.type != "cuda":
            return self.config.kv_cache_memory_gb * 2**30
        activations = self._profile_forward()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        graphs = activations if self._captures_graphs else 0
        return total * self.config.gpu_memory_utilization - (total - free) - activations - graphs

    @torch.inference_mode()
    def _profile_forward(self) -> int:
        """Peak bytes one forward of the largest micro-batch (``max_num_batched_tokens`` tokens
        over as many sequences as a step may hold, every one sampled with top-p) allocates on
        this rank, beyond what is held already. Runs over a throwaway KV cache of just its
        blocks; a later stage takes zeros for the previous stage's output."""
        sched, bs = self.config.scheduler, self.config.block_size
        num_tokens = sched.max_num_batched_tokens
        num_seqs = self._max_logit_rows
        lens = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
        tables, first = [], 0
        for n in lens:
            tables.append(list(range(first, first + math.ceil(n / bs))))
            first += len(tables[-1])
        kv = allocate_kv_cache(self.model_config, num_layers=self.model.num_layers, num_blocks=first,
                               block_size=bs, dtype=self.dtype, device=self.device,
                               num_kv_heads=self.model.num_local_kv_heads)
        step = StepInputs(request_ids=[str(i) for i in range(num_seqs)], token_ids=[0] * num_tokens, query_lens=lens,
                          start_positions=[0] * num_seqs, block_tables=tables, needs_sample=[True] * num_seqs)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        held = torch.cuda.memory_allocated(self.device)
        inputs = to_tensors(step, block_size=bs, device=self.device)
        hidden_in = None
        if not self.ctx.is_first_stage:
            hidden_in = torch.zeros(num_tokens, self.model_config.hidden_size, dtype=self.dtype, device=self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, kv, inputs.meta, hidden_states=hidden_in)
        if self.ctx.is_last_stage:
            logits = self.model.compute_logits(hidden[inputs.sample_indices])
            if self._races:  # (compiled here, not in the first request)
                plain = [SamplingParams(temperature=1.0)] * num_seqs
                self.model.race_token_ids(hidden[inputs.sample_indices], *race_inputs(plain, self.device))
            if self.ctx.is_driver:
                params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50)] * num_seqs
                self.sampler(logits, params, [None] * num_seqs)
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - held

    # ---- one micro-batch ---------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult | PendingResult | None:
        for rid in plan.freed:
            self._generators.pop(rid, None)
        receiver = self.feedback_receiver
        feed = None if receiver is None else receiver.take(plan)
        step = self.plans.step_inputs(plan, can_feed=receiver is not None or not self.ctx.is_first_stage)
        t0 = time.perf_counter()
        inputs = self.runner.prepare(step)
        hidden_in = None
        if not self.ctx.is_first_stage:
            self.busy.begin_recv()
            hidden_in = self._recv(step.num_tokens)
        self.busy.begin(graph=isinstance(inputs, GraphStep))
        hidden = self.runner.forward(inputs, hidden_in, feed)
        if not self.ctx.is_last_stage:
            self.busy.end(plan.step_id)
            # A graph's output buffer is rewritten by the next replay while an isend (on NCCL's
            # stream) may still read it: send a copy.
            self._send(hidden.clone() if isinstance(inputs, GraphStep) else hidden)
            if self.feedback_receiver is not None:
                self.feedback_receiver.post_due()  # sampled ids due, from the driver (feedback.py)
            return None
        # The LM head's collectives come before sampling, so every TP rank joins them in the same
        # order (the driver's feedback sends come after them on every rank). A step whose rows
        # all take their argmax, or all race (decided from the plan alone, the same on every
        # rank), gathers one (value, token) pair a row instead of the full-vocabulary logits.
        sampled = [s for s in plan.seqs if s.needs_sample]
        params, num_done = [s.sampling for s in sampled], [s.num_output_tokens for s in sampled]
        rows = hidden[inputs.sample_indices]
        logits = token_ids = None
        if takes_argmax(params, num_done):
            token_ids = self.model.greedy_token_ids(rows)  # [N]
        elif self._races and takes_race(params, num_done):
            token_ids = self.model.race_token_ids(rows, *race_inputs(params, self.device))  # [N]
        else:
            logits = self.model.compute_logits(rows)  # [N, V]
        prompt = self._prompt_logprobs(plan, hidden)
        if not self.ctx.is_driver:
            self.busy.end(plan.step_id)
            if receiver is not None:  # pp=1, tp > 1: this rank is a first-stage one too
                receiver.post_due()
            return None
        return self._sample(plan, logits, prompt, time.perf_counter() - t0,  # (ends the busy span)
                            token_ids=token_ids)

    def _prompt_logprobs(self, plan: StepPlan, hidden: torch.Tensor) -> tuple[PromptRows, tuple] | None:
        """On the last stage, the LM head over the plan's prompt rows (none: nothing to do);
        on the driver, their rows and logprob tensors, still on the device."""
        rows = prompt_rows(plan)
        if rows is None:
            return None
        tensors = compute_prompt_logprobs(self.model, hidden, rows, max_rows=self._max_logit_rows,
                                          driver=self.ctx.is_driver)
        return None if tensors is None else (rows, tensors)

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

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """This process's structured-output compiler (built on first use: its vocabulary
        index takes a second); an in-process engine validates requests with it too."""
        return self._grammar_state().compiler

    def _grammar_state(self) -> GrammarState:
        if self._grammars is None:
            compiler = GrammarCompiler(self.tokenizer, vocab_size=self.model_config.vocab_size,
                                       eos_token_ids=self.eos_token_ids)
            self._grammars = GrammarState(compiler, self.device)
        return self._grammars

    def _sample(self, plan: StepPlan, logits: torch.Tensor | None, prompt: tuple[PromptRows, tuple] | None,
                seconds: float, *, token_ids: torch.Tensor | None = None) -> StepResult | PendingResult:
        """Samples the plan's sequences from their [N, V] ``logits``, or takes their [N]
        ``token_ids`` (rows that all ``takes_argmax`` or ``takes_race``, with no logits); ``prompt``: its prompt
        rows' logprobs (``_prompt_logprobs``), brought to the host after the sampled ids are on
        their way (a step with prompt rows waits for the device)."""
        self._history.apply_plan(plan)
        if self._grammars is not None:
            self._grammars.apply_plan(plan)
        seqs = [s for s in plan.seqs if s.needs_sample]
        if not seqs:  # prompt chunks only: nothing to sample, feed or wait for
            self.busy.end(plan.step_id)
            return StepResult(step_id=plan.step_id, request_ids=[], token_ids=[], stage_times=[seconds],
                              prompt_logprobs=[] if prompt is None else prompt_logprobs_of(*prompt))
        params = [s.sampling for s in seqs]
        gens = [self._generator_of(s) for s in seqs]
        history = self._history.rows_of(seqs) if len(self._history) else None
        bitmask = self._token_bitmask(seqs)  # on the host, while the device runs this step's forward
        sender = self.feedback_sender

        def on_sampled(token_ids: torch.Tensor) -> None:
            # Sampling is this stage's work too: the span ends once the ids exist on the device.
            self.busy.end(plan.step_id)
            if history is not None:
                self._history.append_sampled(history, token_ids)
            if sender is not None:
                sender.send(token_ids)
            if bitmask is not None:  # the matchers take them before the next mask (no wait here)
                self._grammars.accept_later(seqs, token_ids)

        # With token feedback nothing waits for this result on the critical path: leave the ids
        # on the device and go on to the next plan; serve() sends the result once they are here.
        defer = sender is not None and self.device.type == "cuda"
        if token_ids is not None:  # the rows' argmax or race, taken over the TP ranks' vocab shards
            out = self.sampler.chosen(token_ids, on_sampled=on_sampled, to_host=not defer)
        else:
            out = self.sampler(logits, params, gens, num_output_tokens=[s.num_output_tokens for s in seqs],
                               eos_token_ids=self.eos_token_ids, history=history, token_bitmask=bitmask,
                               on_sampled=on_sampled, to_host=not defer)
        prompt_logprobs = [] if prompt is None else prompt_logprobs_of(*prompt)
        if out.token_ids.device.type != "cpu":
            return PendingResult(plan.step_id, [s.request_id for s in seqs], out.token_ids, seconds,
                                 prompt_logprobs=prompt_logprobs)
        return StepResult(step_id=plan.step_id, request_ids=[s.request_id for s in seqs],
                          token_ids=out.token_ids.tolist(), logprobs=out.logprobs, prompt_logprobs=prompt_logprobs,
                          stage_times=[seconds])

    def _token_bitmask(self, seqs) -> TokenBitmask | None:
        """The step's structured-output masks on the device (None: no row is constrained)."""
        if all(s.sampling.structured_outputs is None for s in seqs):
            return None
        return self._grammar_state().bitmask(seqs)

    def _generator_of(self, seq) -> torch.Generator | None:
        if seq.request_id not in self._generators:
            self._generators[seq.request_id] = make_generator(seq.sampling.seed, self.device)
        return self._generators[seq.request_id]

    def shutdown(self) -> None:
        """Finishes what is in flight, closes the feedback channel and stops counting collections;
        with ``PIPESERVE_STAGE_STATS`` prints this rank's busy summary (one ``STAGE_STATS`` line)."""
        self.wait_sends()
        for end in (self.feedback_sender, self.feedback_receiver):
            if end is not None:
                end.close()
        if self.busy.collections is not None:
            self.busy.collections.close()
        if os.environ.get("PIPESERVE_STAGE_STATS"):
            stats = dict(rank=self.ctx.rank, stage=self.ctx.stage, **self.busy.summary())
            print("STAGE_STATS " + json.dumps(stats), flush=True)

    def release_graphs(self) -> None:
        if self.runner.cuda_graphs is not None:
            self.runner.cuda_graphs.release()
            self.runner.cuda_graphs = None

    def stage_timeline(self) -> dict | None:
        """Benchmarks: this rank's per-step timeline (None unless recorded), read by the bench
        from ``stage_rank{rank}.json`` in ``PIPESERVE_STAGE_STATS_DIR`` (``write_timelines``)."""
        if not self.busy.record:
            return None
        return dict(rank=self.ctx.rank, stage=self.ctx.stage, tp_rank=self.ctx.tp_rank,
                    num_layers=self.model.num_layers, spans=self.busy.timeline(), host=self.busy.host_summary())

    # ---- the loop ----------------------------------------------------------------------------

    def serve(self, channel: WorkerChannel) -> None:
        """Runs plans in order until Shutdown; exits if the engine goes silent. Results leave
        from the channel's sender thread (``send_later``): one whose ids are still on their way
        from the device (``PendingResult``) goes out the moment they are here, while this thread
        takes the next plan and launches it (the engine, holding one plan more in flight than
        results back, sends the plan after next once this result is in: waiting for it here
        would leave the device idle for the next plan's launch every step)."""
        receiver = self.feedback_receiver
        profile_dir = os.environ.get(PROFILE_ENV)
        profiler = cProfile.Profile() if profile_dir else None
        while True:
            timeout = 1.0
            if receiver is not None and receiver.unposted:
                timeout = _IDLE_POST_S
            msg = channel.recv_plan(timeout_s=timeout)
            if msg is None:
                if receiver is not None and receiver.unposted:
                    receiver.post()  # no plan to wait beside any more (feedback.py)
                if not channel.engine_alive():
                    raise SystemExit(EXIT_ENGINE_LOST)
                channel.check_sender()  # a result the engine waits for that cannot come: fail
                self.busy.poll()  # idle: the last steps' busy time reaches the heartbeat
                continue
            if isinstance(msg, Shutdown) or msg.shutdown:
                channel.flush_sends()
                self.shutdown()
                if profiler is not None:
                    _write_profile(profiler, profile_dir, self.ctx.rank)
                return
            if profiler is not None:
                profiler.enable()
            result = self.execute(msg)
            if profiler is not None:
                profiler.disable()
            if result is not None:
                channel.send_later(functools.partial(arrived, result))


def _write_profile(profiler: cProfile.Profile, folder: str, rank: int, top: int = 40) -> None:
    os.makedirs(folder, exist_ok=True)
    out = io.StringIO()
    for key in ("tottime", "cumulative"):
        pstats.Stats(profiler, stream=out).sort_stats(key).print_stats(top)
    with open(os.path.join(folder, f"worker_rank{rank}.txt"), "w") as f:
        f.write(out.getvalue())


class PendingResult:
    """A step's sampled ids on their way to pinned host memory (the driver, token feedback);
    its prompt logprobs, if any, are on the host already."""

    def __init__(self, step_id: int, request_ids: list[str], token_ids: torch.Tensor, seconds: float, *,
                 prompt_logprobs: list[PromptLogprobs]) -> None:
        self.step_id, self.request_ids, self.seconds = step_id, request_ids, seconds
        self.prompt_logprobs = prompt_logprobs
        self.device = token_ids.device
        self.host = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
        self.event = torch.cuda.Event()
        self.token_ids = token_ids  # alive until copied
        self.host.copy_(token_ids, non_blocking=True)
        self.event.record()

    def result(self) -> StepResult:
        """Waits for the ids (from any thread: the channel's sender calls this)."""
        with torch.cuda.device(self.device):  # (a new thread's current device is cuda:0)
            self.event.synchronize()
        return StepResult(step_id=self.step_id, request_ids=self.request_ids, token_ids=self.host.tolist(),
                          prompt_logprobs=self.prompt_logprobs, stage_times=[self.seconds])


def arrived(item: PendingResult | StepResult) -> StepResult:
    """The result to send, once its ids are on the host."""
    return item.result() if isinstance(item, PendingResult) else item


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
        # record: the cycle collector's collections from the first step on
        self.collections = CollectionPauses() if record else None

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
        if self.num_steps == 0 and self.collections is not None:
            self.collections.restart()  # serving starts: start-up's collections are not its own
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
        cached blocks, which synchronizes the device: the host then waits for earlier work);
        and the cycle collector's collections from the first step on (``heap.CollectionPauses``)."""
        out: dict = {}
        for name, graph in (("eager", False), ("graph", True)):
            ms = [(q - t) * 1e3 for _, _, g, t, q in self.steps if g == graph]
            out[name] = {"n": len(ms), "launch_ms_p50": statistics.median(ms) if ms else None,
                         "launch_ms_p90": statistics.quantiles(ms, n=10)[-1] if len(ms) > 1 else None}
        if self.cuda:
            stats = torch.cuda.memory_stats()
            out["allocator"] = {k: stats.get(k, 0) for k in ("num_alloc_retries", "num_device_alloc",
                                                              "num_device_free", "num_sync_all_streams")}
        if self.collections is not None:
            out["gc"] = self.collections.summary()
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


def _device(config: EngineConfig, local_rank: int) -> torch.device:
    if config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def write_timelines(out_dir: str, timelines: list[dict | None]) -> None:
    """``stage_rank{r}.json`` per recorded timeline, each written whole (a reader never sees
    half a file)."""
    os.makedirs(out_dir, exist_ok=True)
    for data in timelines:
        if data is None:
            continue
        path = os.path.join(out_dir, f"stage_rank{data['rank']}.json")
        with open(f"{path}.tmp", "w") as f:
            json.dump(data, f)
        os.replace(f"{path}.tmp", path)


def run_worker(config: EngineConfig, *, record: bool | None = None, start_timeout_s: float = 600.0) -> None:
    """One torchrun rank's life as a worker: join the process group, take the engine's
    endpoints from rank 0 (``PIPESERVE_PLAN_ENDPOINT`` / ``_RESULT_ENDPOINT`` in its
    environment; the other ranks may be on other nodes), load this rank's slice, serve plans
    until the engine shuts down. With a recorded timeline, every rank's ends up in rank 0's
    ``PIPESERVE_STAGE_STATS_DIR``. Exits the process (code 1) on an error, after telling the
    engine."""
    parent_pid = os.getppid()  # before loading: a launcher killed meanwhile leaves a new parent
    rank, local_rank, world = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    if rank != 0:
        progress.quiet()  # one set of progress lines per engine: global rank 0's
    if world != config.parallel.world_size:
        raise ValueError(f"torchrun started {world} ranks but parallel.tp × parallel.pp = {config.parallel.world_size}")
    device = _device(config, local_rank)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    ctx = build_parallel_context(config.parallel.tp, config.parallel.pp, token_feedback=config.parallel.feedback)
    # Waits for rank 0's engine to start, and after the run for the slowest rank's timeline:
    # bounded, so a lost rank cannot hang the others for long.
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=start_timeout_s + 60))
    endpoints = None
    if rank == 0:
        endpoints = {"plan": os.environ["PIPESERVE_PLAN_ENDPOINT"], "result": os.environ["PIPESERVE_RESULT_ENDPOINT"],
                     "key_file": os.environ.get(KEY_FILE_ENV)}
    endpoints = broadcast_json(endpoints, control)
    key = _control_key(endpoints["key_file"], rank, control)
    transport = TransportConfig(liveness_timeout_s=config.parallel.liveness_timeout_s,
                                handshake_timeout_s=start_timeout_s)
    channel = None
    try:
        torch.manual_seed(config.seed)
        channel = WorkerChannel(
            transport, rank=rank, world_size=ctx.world_size, stage=ctx.stage, tp_rank=ctx.tp_rank,
            plan_endpoint=endpoints["plan"], result_endpoint=endpoints["result"], key=key,
            # A worker blocked in a collective cannot poll: leave from the heartbeat thread.
            on_engine_lost=lambda: os._exit(EXIT_ENGINE_LOST),
            parent_pid=parent_pid,
        )
        channel.watch_start_up(functools.partial(_stopped_while_loading, rank))  # subscribed while it loads
        worker = Worker(config, ctx, device, record=record)
        freeze_start_up_heap()  # the loaded rank's objects: no full collection walks them again
        # Each stage's TP rank 0 reports the stage's busy time on its heartbeats.
        channel.loaded(num_kv_blocks=worker.num_kv_blocks,
                       busy_s=(lambda: worker.busy.busy_s) if ctx.tp_rank == 0 else None)
        channel.handshake()
        worker.serve(channel)
    except (EngineShutdown, LauncherGone) as e:  # stopped during start-up: nobody to tell
        print(f"pipeserve worker: {e}", file=sys.stderr)
        sys.exit(0 if isinstance(e, EngineShutdown) else 1)
    except Exception as e:
        if channel is not None:
            channel.send(WorkerError(rank=rank, message=f"{type(e).__name__}: {e}"))
        traceback.print_exc()
        sys.exit(1)
    finally:
        if channel is not None:
            channel.close()
    if worker.busy.record:
        timelines = gather_timelines(worker.stage_timeline(), rank, ctx.world_size, control)
        if timelines is not None and (out_dir := os.environ.get(STAGE_STATS_DIR_ENV)):
            write_timelines(out_dir, timelines)
    worker.release_graphs()  # before the communicators go (CudaGraphRunner.release)
    dist.destroy_process_group()
    thaw_heap()  # an SPMD rank returns into its user's program


def _stopped_while_loading(rank: int, reason: str) -> None:
    """The engine stopped while this rank loaded: leave now (exit 0, as on a Shutdown during the
    handshake), whatever collective the loading thread is in; the other ranks leave alike."""
    print(f"pipeserve worker: rank {rank}: the engine shut down while this rank loaded ({reason})",
          file=sys.stderr, flush=True)
    os._exit(0)


def _control_key(key_file: str | None, rank: int, control) -> RunKey:
    """The run's control key: from this rank's environment, else from the file rank 0 named
    (the ranks of an outer torchrun share no environment with its engine). Rank 0 removes the
    file once every rank has its key."""
    try:
        key = RunKey.from_env()
        if key is None and key_file is None:
            raise ValueError(f"no control key: set {KEY_ENV} in every rank's environment")
        key = key or RunKey.from_file(key_file)
    finally:
        dist.barrier(group=control)
        if rank == 0 and key_file is not None:
            remove_key_file(key_file)
    return key


def main() -> None:
    """A worker process, started by the engine: one rank of the torchrun it launched, or under
    an outer torchrun the rank 0 that the program on rank 0 started (which leaves SIGTERM to
    the engine: it drains, then shuts the workers down)."""
    if os.environ.get(IGNORE_SIGTERM_ENV):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    run_worker(engine_config_from_dict(json.loads(os.environ["PIPESERVE_ENGINE_CONFIG"])))


if __name__ == "__main__":
    main()
