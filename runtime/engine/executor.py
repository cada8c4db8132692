"""Executors run the engine's micro-batches on workers: one in this process, or tp × pp
torchrun ranks. Both drive the same ``Worker`` (runtime/worker/worker.py) with the same
``StepPlan``s, so input preparation, CUDA graphs, KV sizing and sampling exist once.

The engine loop is the same for both: ``submit(plan)`` up to ``max_in_flight`` plans, then
``result(plan)`` for the oldest. Only token ids (and optional logprobs, of sampled and prompt
tokens) come back. Both say how long each pipeline stage has computed so far
(``stage_busy_seconds``), for /metrics.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from pipeserve.parallel.auth import RunKey
from pipeserve.parallel.torchrun import LOOPBACK
from pipeserve.parallel.transport import EngineChannel, TransportConfig, TransportError
from pipeserve.parallel.wire import (
    BlockTableDiffer,
    LogprobRows,
    PromptLogprobs,
    SeqPlan,
    Shutdown,
    StepPlan,
    StepResult,
    TokenLogprobs,
    WorkerError,
)
from pipeserve.runtime.worker.worker import STAGE_STATS_DIR_ENV, PendingResult, arrived, write_timelines
from pipeserve.scheduler import SamplingParams, SchedulerOutput

class WorkerFailure(RuntimeError):
    """A worker died, hung or reported an error; the engine cannot go on."""


@dataclass(slots=True)
class SampleRequest:
    """What sampling one sequence needs beside its logits (its generator lives on the worker)."""

    params: SamplingParams
    num_output_tokens: int


@dataclass(slots=True)
class Sampled:
    """A step's result, by request: sampled ids, their logprobs, the prompt chunks' logprobs."""

    token_ids: dict[str, int]
    logprobs: LogprobRows | None
    rows: dict[str, int]  # request id -> its row of ``logprobs`` (empty without them)
    prompt_logprobs: list[PromptLogprobs]

    @classmethod
    def of(cls, r: StepResult) -> Sampled:
        rows = {} if r.logprobs is None else {rid: i for i, rid in enumerate(r.request_ids)}
        return cls(dict(zip(r.request_ids, r.token_ids)), r.logprobs, rows, r.prompt_logprobs)

    def logprobs_of(self, request_id: str, num_top: int) -> TokenLogprobs | None:
        """The sampled token's logprobs with the top ``num_top`` (None: the step has none)."""
        if self.logprobs is None:
            return None
        return self.logprobs.entry(self.rows[request_id], num_top)


class PlanBuilder:
    """The engine-side state of the plans on their way to the workers: block tables travel as
    diffs (``BlockTableDiffer``), and finished requests are announced in the next plan's
    ``freed`` so workers drop their mirrors and sampler state."""

    def __init__(self) -> None:
        self._differ = BlockTableDiffer()
        self._restarts: dict[str, int] = {}  # request id -> its num_preemptions at its last plan
        self._freed: list[str] = []

    def build(self, plan: SchedulerOutput, samples: dict[str, SampleRequest]) -> StepPlan:
        seqs = [self._seq_plan(s, samples.get(s.request_id)) for s in plan.scheduled]
        step = StepPlan(step_id=plan.step_id, seqs=seqs, freed=self._freed)
        self._freed = []
        return step

    def _seq_plan(self, s, sample: SampleRequest | None) -> SeqPlan:
        start = s.num_computed_tokens
        if self._restarts.get(s.request_id, 0) != s.request.num_preemptions:
            # Preempted since its last plan (maybe in an empty plan, never submitted): its new
            # table may hold its old blocks at other positions, so it must go in full.
            self._differ.forget(s.request_id)
            self._restarts[s.request_id] = s.request.num_preemptions
        full, diff = self._differ.plan_for(s.request_id, s.block_table)
        targets = _prompt_logprob_targets(s)
        return SeqPlan(
            request_id=s.request_id,
            num_computed_tokens=start,
            num_scheduled_tokens=s.num_scheduled_tokens,
            new_token_ids=s.request.token_ids_between(start, start + s.num_scheduled_tokens),
            block_table=full,
            block_table_diff=diff,
            needs_sample=s.needs_sample,
            sampling=_sampling_of(s, sample, scores_prompt=targets is not None),
            num_output_tokens=0 if sample is None else sample.num_output_tokens,
            feed_step=s.feed_step,
            prompt_logprob_targets=targets,
        )

    def free(self, request_id: str) -> None:
        """The request is finished (or aborted): workers drop its state with the next plan."""
        self._freed.append(request_id)
        self._differ.forget(request_id)
        self._restarts.pop(request_id, None)


def _prompt_logprob_targets(s) -> list[int] | None:
    """The prompt tokens a chunk's rows score, for a request that asks for prompt logprobs and
    has no output yet (one preempted later has them all already): the tokens after the chunk's
    positions, up to the prompt's end. None where there are none."""
    request = s.request
    params = request.sampling_params
    if params is None or params.prompt_logprobs is None or request.num_output_tokens:
        return None
    start, end = s.num_computed_tokens + 1, min(s.context_len + 1, request.num_prompt_tokens)
    return request.prompt_token_ids[start:end] if start < end else None


def _sampling_of(s, sample: SampleRequest | None, *, scores_prompt: bool) -> SamplingParams | None:
    """A sequence's SamplingParams where it samples, on every chunk of a request whose
    repetition penalty counts its prompt too (the sampling worker keeps its tokens), and on a
    chunk that scores prompt tokens (the worker reads ``prompt_logprobs``)."""
    if sample is not None:
        return sample.params
    params = s.request.sampling_params
    return params if params is not None and (scores_prompt or params.repetition_penalty != 1.0) else None


class InProcessExecutor:
    """One device: the ``Worker`` a torchrun rank runs, in this process, as a group of one.
    Each plan is queued on the device when submitted. With token feedback (a GPU) the worker
    leaves the sampled ids on the device and the next plan is submitted before they are read
    back: ``result`` waits for them while the device computes that next plan."""

    def __init__(self, worker, *, depth: int = 1) -> None:
        self.worker = worker
        self.max_in_flight = depth
        self.num_kv_blocks = worker.num_kv_blocks
        self._plans = PlanBuilder()
        self._done: dict[int, StepResult | PendingResult] = {}

    def submit(self, plan: SchedulerOutput, samples: dict[str, SampleRequest]) -> None:
        result = self.worker.execute(self._plans.build(plan, samples))
        assert result is not None, "a group of one samples every plan"
        self._done[plan.step_id] = result

    def result(self, plan: SchedulerOutput) -> Sampled:
        return Sampled.of(arrived(self._done.pop(plan.step_id)))

    def stage_busy_seconds(self) -> list[float]:
        """The one stage's compute time so far (the worker's ``BusyTimer``)."""
        self.worker.busy.poll()
        return [self.worker.busy.busy_s]

    def free(self, request_id: str) -> None:
        self._plans.free(request_id)

    def idle(self) -> None:
        pass

    def num_rejected(self) -> int:
        """Control-plane connections refused and frames dropped: none in one process."""
        return 0

    def close(self) -> None:
        self.worker.shutdown()
        if out_dir := os.environ.get(STAGE_STATS_DIR_ENV):
            write_timelines(out_dir, [self.worker.stage_timeline()])


class DistributedExecutor:
    """tp × pp workers under torchrun, driven over ZeroMQ (plans out, results back). A worker
    that dies, hangs or reports an error raises ``WorkerFailure`` within the liveness timeout.
    """

    def __init__(self, *, world_size: int, depth: int, host: str, liveness_timeout_s: float,
                 launch, handshake_timeout_s: float = 600.0) -> None:
        """`launch(env)` starts the workers with `env` added to their environment (the engine's
        endpoints and the run's control key) and returns a Popen (or None when they are started
        by someone else, e.g. SPMD under torchrun). The key is ``PIPESERVE_CONTROL_KEY`` when
        set (a job shares one across nodes), else a new one."""
        self.max_in_flight = depth
        self._plans = PlanBuilder()
        self._results: dict[int, StepResult] = {}
        self.channel = EngineChannel(
            TransportConfig(host=host, liveness_timeout_s=liveness_timeout_s,
                            handshake_timeout_s=handshake_timeout_s),
            world_size, key=RunKey.from_env() or RunKey.generate(),
        )
        self.proc: subprocess.Popen | None = None
        self._own_workers: dict[int, int] = {}  # rank -> pid, once they have said Hello
        try:
            self.proc = launch(self.channel.worker_env())
            hellos = self.channel.handshake(failed=self._exited)
        except BaseException:
            self.close()
            raise
        self.num_kv_blocks = min(h.num_kv_blocks for h in hellos.values())
        self.num_stages = max(h.stage for h in hellos.values()) + 1
        # The workers this engine started are watched by pid: one that dies is noticed at the next
        # health check, not after its peers' timeouts (they ignore SIGTERM, so torchrun's clean-up
        # of a failed group waits 30 s before SIGKILL).
        started = None if self.proc is None else self.proc.pid
        self._own_workers = {h.rank: h.pid for h in hellos.values()
                             if started is not None and started in (h.pid, _parent(h.pid))}
        self.channel.start_heartbeats()
        atexit.register(self.close)  # never leave workers behind a script that forgot close()
        self._closed = False

    def submit(self, plan: SchedulerOutput, samples: dict[str, SampleRequest]) -> None:
        self.channel.send_plan(self._plans.build(plan, samples))

    def result(self, plan: SchedulerOutput) -> Sampled:
        while plan.step_id not in self._results:
            msg = self.channel.recv(timeout_s=0.5)
            if msg is None:
                self._check_health()
            elif isinstance(msg, StepResult):
                self._results[msg.step_id] = msg
            elif isinstance(msg, WorkerError):
                failed = f"worker rank {msg.rank} failed: {msg.message}"
                # A rank whose peer died fails in its next collective, often before the engine
                # has seen the death: name the one that died first.
                if reason := self._exited():
                    raise WorkerFailure(f"{reason}; then {failed}")
                raise WorkerFailure(failed)
        r = self._results.pop(plan.step_id)
        if r.error:
            raise WorkerFailure(f"step {r.step_id} failed on the last stage: {r.error}")
        return Sampled.of(r)

    def stage_busy_seconds(self) -> list[float]:
        """Per stage, its compute time so far, as its TP rank 0 last reported it (on every
        heartbeat: the figures trail by up to ``heartbeat_interval_s``)."""
        busy = self.channel.stage_busy_s
        return [busy.get(stage, 0.0) for stage in range(self.num_stages)]

    def free(self, request_id: str) -> None:
        self._plans.free(request_id)

    def num_rejected(self) -> int:
        """Connections to the workers' control plane refused so far, and frames dropped as malformed."""
        return self.channel.num_rejected + self.channel.num_malformed

    def idle(self) -> None:
        """Called by an idle engine loop: keeps the engine heartbeat going, checks workers."""
        self.channel.tick()
        self._check_health()

    def _exited(self) -> str | None:
        if self.proc is not None and (code := self.proc.poll()) is not None:
            return f"the worker processes exited with code {code}"
        for rank, pid in self._own_workers.items():
            if not _running(pid):
                return f"worker rank {rank} (pid {pid}) exited"
        return None

    def _check_health(self) -> None:
        if reason := self._exited():
            raise WorkerFailure(reason)
        if dead := self.channel.check_liveness():
            raise WorkerFailure(
                f"worker rank(s) {dead} sent nothing for {self.channel.config.liveness_timeout_s:g}s"
            )

    def close(self) -> None:
        """Asks the workers to exit, then makes sure they have (no orphans)."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        try:
            self.channel.send_plan(Shutdown(reason="engine closed"))
        except TransportError:
            pass
        if self.proc is not None:
            _reap(self.proc, grace_s=15.0)
        self.channel.close()


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (state, ppid, …); None if unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _parent(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[1]) if fields else None


def _running(pid: int) -> bool:
    """The process exists and has not exited (a zombie has)."""
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def _reap(proc: subprocess.Popen, grace_s: float) -> None:
    """Wait for `proc` (a torchrun in its own session); then SIGTERM, then SIGKILL its group."""
    deadline = time.monotonic() + grace_s
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            pass
    _kill_group(proc.pid)


def _kill_group(pgid: int) -> None:
    """Workers that outlived torchrun (they should not) go too."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# `python -c THIS args…` runs `python args…` with SIGTERM ignored.
_EXEC_IGNORING_SIGTERM = ("import os, signal, sys; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                          "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")


def launch_torchrun(world_size: int, env: dict[str, str]):
    """A launcher for DistributedExecutor: one torchrun of `world_size` workers on this node,
    whose store, Gloo and NCCL listen on the loopback interface only
    (``parallel/torchrun.py``; the workers meet the engine at its own address)."""

    def launch(channel_env: dict[str, str]) -> subprocess.Popen:
        full_env = dict(os.environ, **env, **channel_env)
        # torchrun would set 1 itself, with a banner on every start.
        full_env.setdefault("OMP_NUM_THREADS", "1")
        # SIGTERM is the engine's to act on: Slurm (scancel, the time limit) sends it to every
        # process of the job at once, and the engine drains its requests, then shuts the workers
        # down itself. So torchrun neither handles nor forwards it, and it and the workers start
        # with it ignored (dispositions set to ignore survive exec).
        full_env.update(PET_SIGNALS_TO_HANDLE="SIGINT,SIGHUP,SIGQUIT", PIPESERVE_WORKER_IGNORE_SIGTERM="1")
        cmd = [sys.executable, "-c", _EXEC_IGNORING_SIGTERM, "-m", "pipeserve.parallel.torchrun",
               f"--host={LOOPBACK}", f"--nproc-per-node={world_size}", "-m", "pipeserve.runtime.worker.worker"]
        # Own session: the whole worker tree can be signalled (and reaped) as one group.
        return subprocess.Popen(cmd, env=full_env, start_new_session=True)

    return launch
