"""The engine loop, one process: schedule → run → update → postprocess.

The scheduler owns token accounting and KV blocks; the model runner owns tensors; this file
owns what a request is to the user: its sampling state, its text, its stop conditions.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from pipeserve.parallel.context import ParallelContext
from pipeserve.parallel.stage_plan import plan_model_stages
from pipeserve.parallel.tp_layers import check_reduction_layout
from pipeserve.parallel.wire import PromptLogprobs, TokenLogprobs
from pipeserve.runtime.config import EngineConfig, engine_config_to_dict
from pipeserve.runtime.engine import spmd
from pipeserve.runtime.engine.executor import (
    DistributedExecutor,
    InProcessExecutor,
    Sampled,
    SampleRequest,
    WorkerFailure,
    launch_torchrun,
)
from pipeserve.runtime.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, RequestOutputKind
from pipeserve.runtime.engine.stop import check_stop
from pipeserve.runtime.model.loader import LoadedModel, read_config_and_tokenizer
from pipeserve.runtime.model.tokenizer import IncrementalDetokenizer
from pipeserve.runtime.worker.grammar import GrammarCompiler
from pipeserve.runtime.worker.worker import Worker
from pipeserve.scheduler import (
    CostModel, Request, RequestStatus, SamplingParams, Scheduler, SchedulerLimits, SchedulerOutput, SlidingLayers,
)

_FINISH_STATUS = {
    "stop": RequestStatus.FINISHED_STOPPED,
    "length": RequestStatus.FINISHED_LENGTH,
    "abort": RequestStatus.FINISHED_ABORTED,
}


@dataclass(slots=True)
class _RequestState:
    """What the engine keeps per request beside the scheduler's token accounting."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    detokenizer: IncrementalDetokenizer
    metrics: RequestMetrics
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    text: str = ""
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    output_token_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One submitted micro-batch: (request id, first position, tokens, samples?) per sequence,
    the step ids in flight at submission (this one included), the cost model's predicted
    seconds (0.0 without a cost model), and the steps whose sampled ids its fed decodes take
    (token feedback; empty without)."""

    step_id: int
    submitted_at: float
    seqs: tuple[tuple[str, int, int, bool], ...]
    in_flight: tuple[int, ...]
    predicted_time: float = 0.0
    fed_from: tuple[int, ...] = ()

    @classmethod
    def of(cls, plan: SchedulerOutput, in_flight) -> StepRecord:
        seqs = tuple(
            (s.request_id, s.num_computed_tokens, s.num_scheduled_tokens, s.needs_sample) for s in plan.scheduled
        )
        fed_from = tuple(sorted({s.feed_step for s in plan.scheduled if s.feed_step >= 0}))
        return cls(plan.step_id, time.monotonic(), seqs, tuple(p.step_id for p in in_flight), plan.predicted_time,
                   fed_from)


@dataclass(frozen=True, slots=True)
class EngineState:
    """Values found at start-up (not user configuration)."""

    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    num_kv_blocks: int
    eos_token_ids: tuple[int, ...]


class LLMEngine:
    def __init__(self, config: EngineConfig, *, loaded: LoadedModel | None = None, launch=None,
                 record_steps: bool = False) -> None:
        """One device: the worker runs in this process (``loaded`` reuses a whole model already
        in memory: sweeps and tests build several engines). tp × pp > 1: ``launch(plan_endpoint,
        result_endpoint)`` starts the workers (default: a torchrun). ``record_steps``: keep a
        ``StepRecord`` of every micro-batch (benchmarks)."""
        self.config = config
        device = config.torch_device()
        dtype = config.torch_dtype(device)
        torch.manual_seed(config.seed)
        par = config.parallel
        if par.world_size == 1:  # a group of one, in this process
            worker = Worker(config, ParallelContext.single(), device, loaded=loaded)
            model_config, self.tokenizer = worker.model_config, worker.tokenizer
            self.stage_layers, max_model_len = _check_layout(config, model_config)
            self.executor = InProcessExecutor(worker, depth=par.depth)
        else:
            model_config, self.tokenizer, _ = read_config_and_tokenizer(config.model)
            self.stage_layers, max_model_len = _check_layout(config, model_config)  # before any worker starts
            self.executor = _distributed_executor(config, launch)
        self.model_config = model_config
        eos = tuple(model_config.eos_token_ids) or tuple(self.tokenizer.eos_token_ids)
        num_blocks = self.executor.num_kv_blocks
        self.state = EngineState(
            device=device, dtype=dtype, max_model_len=max_model_len, num_kv_blocks=num_blocks,
            eos_token_ids=eos,
        )
        limits = SchedulerLimits(max_model_len=max_model_len, feedback_distance=par.feedback_distance,
                                 sliding_layers=SlidingLayers.of(model_config.layer_windows))
        try:
            self.scheduler = Scheduler(config.scheduler, limits=limits, num_blocks=num_blocks,
                                       block_size=config.block_size, cost_model=_cost_model(config.scheduler, device))
        except ValueError:
            self.executor.close()
            raise
        self._requests: dict[str, _RequestState] = {}
        self._grammars: GrammarCompiler | None = None  # built on the first structured-output request
        self._unscheduled: set[str] = set()  # requests without first_scheduled_time yet
        self._in_flight: deque[SchedulerOutput] = deque()
        self._ids = itertools.count()
        self.step_records: list[StepRecord] | None = [] if record_steps else None
        # With record_steps: step id -> time.monotonic() when its result was back.
        self.step_done_times: dict[int, float] | None = {} if record_steps else None

    def close(self) -> None:
        """Stops the workers (if any). The engine is unusable afterwards."""
        self.executor.close()

    # ---- requests in -------------------------------------------------------------------------

    def new_request_id(self) -> str:
        return str(next(self._ids))

    def validate(self, prompt: str | list[int], params: SamplingParams) -> tuple[str | None, list[int], int]:
        """Checks one request without changing anything; returns (text, token ids, max_tokens).
        A structured-output constraint is compiled here (a bad one is a ValueError), so the
        sampling worker later finds it in its compiler's cache (one device) or compiles a spec
        known to be good (torchrun)."""
        checked = validate_request(
            prompt, params, tokenizer=self.tokenizer, vocab_size=self.model_config.vocab_size,
            max_model_len=self.state.max_model_len,
        )
        if params.structured_outputs is not None:
            self._grammar_compiler().compile(params.structured_outputs)
        return checked

    def _grammar_compiler(self) -> GrammarCompiler:
        if self._grammars is None:
            worker = getattr(self.executor, "worker", None)  # one device: share the worker's cache
            self._grammars = worker.grammar_compiler if worker is not None else GrammarCompiler(
                self.tokenizer, vocab_size=self.model_config.vocab_size, eos_token_ids=self.state.eos_token_ids)
        return self._grammars

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        arrival_time: float | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
    ) -> None:
        """Adds one sequence (n is expanded by the caller). ValueError leaves the engine untouched.
        ``output_kind``: whether step() returns its output after every token or only at the end."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids, max_tokens = self.validate(prompt, params)
        params = resolve_bad_words(params, self.tokenizer, vocab_size=self.model_config.vocab_size)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        # Prompt logprobs need every prompt position's logits: no prefix-cache hit may skip one.
        self.scheduler.add_request(
            Request(request_id, ids, arrival_time=arrival, sampling_params=params, max_output_tokens=max_tokens,
                    skip_reading_prefix_cache=params.prompt_logprobs is not None)
        )
        self._requests[request_id] = _RequestState(
            prompt=text,
            prompt_token_ids=ids,
            params=params,
            max_tokens=max_tokens,
            detokenizer=IncrementalDetokenizer(self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens),
            metrics=RequestMetrics(arrival_time=arrival),
            output_kind=output_kind,
            logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )
        self._unscheduled.add(request_id)

    def abort_request(self, request_id: str) -> bool:
        """Frees the request's KV blocks; its next output reports finish_reason "abort"."""
        state = self._requests.get(request_id)
        if state is None or state.finish_reason is not None:
            return False
        self.scheduler.abort_request(request_id)
        self.executor.free(request_id)
        state.finish_reason = "abort"
        state.metrics.finished_time = time.monotonic()
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the loop ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Keeps up to `max_in_flight` micro-batches in the pipeline, then completes the oldest;
        returns the outputs of the requests that gained a token (FINAL_ONLY ones: that finished)."""
        self._fill_pipeline()
        if not self._in_flight:
            if self.scheduler.has_unfinished_requests():
                raise RuntimeError("scheduler made no progress with requests pending (KV pool too small?)")
            return []
        plan = self._in_flight.popleft()
        try:
            sampled = self.executor.result(plan)
        except WorkerFailure as e:
            self._fail_all(str(e))
            raise
        if self.step_done_times is not None:
            self.step_done_times[plan.step_id] = time.monotonic()
        for chunk in sampled.prompt_logprobs:
            self._take_prompt_logprobs(chunk)
        updated = self.scheduler.update(plan, sampled.token_ids)
        now = time.monotonic()  # every token of this step arrived at once
        outputs = (self._postprocess(req, sampled, now) for req in updated)
        return [out for out in outputs if out is not None]

    def _take_prompt_logprobs(self, chunk: PromptLogprobs) -> None:
        """Appends a prompt chunk's positions to its request's prompt logprobs. Results come in
        step order, so positions arrive in order; a prompt recomputed after a preemption sends
        the positions held already again, which are skipped."""
        st = self._requests.get(chunk.request_id)
        if st is None or st.prompt_logprobs is None:  # finished (aborted) since
            return
        held = st.prompt_logprobs
        assert chunk.start <= len(held), (chunk.request_id, chunk.start, len(held))
        num_top = st.params.prompt_logprobs
        first_new = len(held) - chunk.start
        held += [chunk.rows.entry(row, num_top) for row in range(first_new, chunk.rows.num_rows)]

    def _fill_pipeline(self) -> None:
        while len(self._in_flight) < self.executor.max_in_flight:
            plan = self.scheduler.schedule()
            if plan.is_empty:
                return
            self._mark_scheduled(plan)
            requests = self._requests
            samples = {s.request_id: _sample_request(requests[s.request_id], s) for s in plan.scheduled if s.needs_sample}
            self.executor.submit(plan, samples)
            self._in_flight.append(plan)
            if self.step_records is not None:
                self.step_records.append(StepRecord.of(plan, self._in_flight))

    def _fail_all(self, message: str) -> None:
        """A worker failure: every unfinished request ends with finish_reason "error"."""
        for rid, st in self._requests.items():
            if st.finish_reason is None:
                self.scheduler.finish_request(rid, RequestStatus.FINISHED_ERROR)
                st.finish_reason, st.error = "error", message
        self._in_flight.clear()

    def _mark_scheduled(self, plan: SchedulerOutput) -> None:
        if not self._unscheduled:  # the usual decode step: every request was scheduled before
            return
        now = time.monotonic()
        for s in plan.scheduled:
            if s.request_id in self._unscheduled:
                self._unscheduled.remove(s.request_id)
                metrics = self._requests[s.request_id].metrics
                metrics.first_scheduled_time = now
                metrics.num_cached_tokens = s.num_computed_tokens  # the prefix-cache hit it starts from

    def _postprocess(self, req: Request, sampled: Sampled, now: float) -> RequestOutput | None:
        """Takes the request's new token; its output, or None while a FINAL_ONLY one runs."""
        state = self._requests[req.request_id]
        token = req.output_token_ids[-1]
        metrics = state.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.token_times.append(now)
        state.output_token_ids.append(token)
        if state.logprobs is not None:
            state.logprobs.append(sampled.logprobs_of(req.request_id, state.params.logprobs))
        delta = state.detokenizer.step(token)
        reason, stop_reason, text = check_stop(
            output_token_ids=state.output_token_ids,
            output_text=state.detokenizer.text,
            new_text_len=len(delta),
            params=state.params,
            eos_token_ids=self.state.eos_token_ids,
            max_tokens=state.max_tokens,
        )
        state.text = text
        if reason is not None:
            state.finish_reason, state.stop_reason = reason, stop_reason
            metrics.finished_time = now
            self.scheduler.finish_request(req.request_id, _FINISH_STATUS[reason])
            self.executor.free(req.request_id)
        elif state.output_kind is RequestOutputKind.FINAL_ONLY:
            return None
        return self._output(req.request_id, state)

    def _output(self, request_id: str, st: _RequestState) -> RequestOutput:
        finished = st.finish_reason is not None
        token_ids, logprobs = st.output_token_ids, st.logprobs
        if finished:  # the state is dropped: its lists go out as they are
            del self._requests[request_id]
            self._unscheduled.discard(request_id)
        else:  # copies, so that an output handed out earlier never changes
            token_ids = token_ids.copy()
            logprobs = None if logprobs is None else logprobs.copy()
        # Positional, in field order: keyword arguments would double the cost of these two
        # objects, built for every request on every step.
        completion = CompletionOutput(0, st.text, token_ids, st.finish_reason, logprobs, st.stop_reason)
        return RequestOutput(
            request_id, st.prompt, st.prompt_token_ids, [completion], finished, st.metrics, st.error,
            st.prompt_logprobs,
        )

    def take_aborted(self, request_id: str) -> RequestOutput:
        """The final output of an aborted request (and forgets it)."""
        return self._output(request_id, self._requests[request_id])


def _sample_request(st: _RequestState, s) -> SampleRequest:
    # The token sampled after position context_len - 1 is output number context_len - prompt
    # (with token feedback the earlier outputs may still be in flight).
    return SampleRequest(st.params, s.context_len - s.request.num_prompt_tokens)


def validate_request(
    prompt: str | list[int], params: SamplingParams, *, tokenizer, vocab_size: int, max_model_len: int
) -> tuple[str | None, list[int], int]:
    """ValueError with a clear message for a request the engine cannot serve; otherwise
    (prompt text or None, prompt token ids, resolved max_tokens)."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
    if isinstance(prompt, str):
        text, ids = prompt, tokenizer.encode(prompt)
    elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
        text, ids = None, list(prompt)
    else:
        raise ValueError("a prompt must be a string or a list of token ids")
    if not ids:
        raise ValueError("the prompt is empty")
    if any(t < 0 or t >= vocab_size for t in ids):
        raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
    if any(t >= vocab_size for t in params.stop_token_ids):
        raise ValueError(f"stop_token_ids must be in [0, {vocab_size}), the model's vocabulary")
    if any(t >= vocab_size for t in params.logit_bias or ()):
        raise ValueError(f"logit_bias token ids must be in [0, {vocab_size}), the model's vocabulary")
    if any(t >= vocab_size for t in params.allowed_token_ids or ()):
        raise ValueError(f"allowed_token_ids must be in [0, {vocab_size}), the model's vocabulary")
    if params.top_k > vocab_size:
        raise ValueError(f"top_k must be at most the vocabulary size ({vocab_size}), got {params.top_k}")
    if len(ids) >= max_model_len:
        raise ValueError(
            f"the prompt has {len(ids)} tokens; max_model_len is {max_model_len}, which leaves no room to generate"
        )
    max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len - len(ids)
    if len(ids) + max_tokens > max_model_len:
        raise ValueError(
            f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds max_model_len ({max_model_len})"
        )
    return text, ids, max_tokens


def resolve_bad_words(params: SamplingParams, tokenizer, *, vocab_size: int) -> SamplingParams:
    """``params`` with its ``bad_words`` as token ids for the sampler (vLLM's
    ``update_from_tokenizer``): each word's tokens as it would start the text, and as it would
    follow a space where that gives other tokens of the same count (a word mid-text)."""
    if not params.bad_words or params._bad_words_token_ids is not None:
        return params
    sequences: list[list[int]] = []
    for word in params.bad_words:
        alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        sequences.append(alone)
        if spaced[0] != alone[0] and len(spaced) == len(alone):
            sequences.append(spaced)
    if any(t >= vocab_size for ids in sequences for t in ids):
        raise ValueError(f"bad_words hold tokens outside the model's vocabulary ({vocab_size})")
    return params.clone(_bad_words_token_ids=sequences)


def _resolve_max_model_len(requested: int | None, model_limit: int) -> int:
    if requested is None:
        return model_limit
    if requested > model_limit:
        raise ValueError(f"max_model_len {requested} exceeds the model's context length {model_limit}")
    return requested


def _check_layout(config: EngineConfig, model_config) -> tuple[list, int]:
    """(every stage's layers, as each worker plans them; the context length): a bad
    ``stage_layers``, ``max_model_len`` or deterministic reduction layout is a ValueError here."""
    par = config.parallel
    if config.deterministic:
        check_reduction_layout(
            num_heads=model_config.num_attention_heads, num_kv_heads=model_config.num_key_value_heads,
            head_dim=model_config.head_dim, intermediate_size=model_config.intermediate_size,
            splits=config.effective_reduction_splits, tp_size=par.tp,
        )
    stages = plan_model_stages(model_config, par.pp, override=par.stage_layers)
    return stages, _resolve_max_model_len(config.max_model_len, model_config.max_position_embeddings)


def _cost_model(config, device: torch.device) -> CostModel | None:
    """The profile's cost model; the analytic (CPU-scale) default when only a time budget is set."""
    if config.cost_model_path is not None:
        return CostModel.load(config.cost_model_path)
    if config.time_budget_s is None:
        return None
    if device.type == "cuda":
        print("pipeserve: time_budget_s without scheduler.cost_model_path uses the CPU-scale analytic"
              " cost model; run `pipeserve profile` on this card", file=sys.stderr)
    return CostModel.analytic_default()


def _distributed_executor(config: EngineConfig, launch) -> DistributedExecutor:
    config = spmd.with_rendezvous_host(config)  # across nodes: reachable from the other nodes
    par = config.parallel
    if launch is None:
        env = {"PIPESERVE_ENGINE_CONFIG": json.dumps(engine_config_to_dict(config))}
        if spmd.under_torchrun():  # the other ranks are the workers already; this one's is a child
            launch = spmd.launch_rank0_worker(env)
        else:
            launch = launch_torchrun(par.world_size, env)
    return DistributedExecutor(
        world_size=par.world_size, depth=par.depth, host=par.bind_host,
        liveness_timeout_s=par.liveness_timeout_s, launch=launch,
    )
