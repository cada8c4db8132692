"""The control-plane wire schema: typed, versioned msgspec messages (never pickle).

Engine → workers: ``Ready`` (handshake), ``StepPlan`` (one per micro-batch), ``Heartbeat``
(rank ``ENGINE_RANK``) and ``Shutdown``. Workers → engine: ``Hello``, ``StepResult`` (last
stage, TP rank 0), ``Heartbeat`` and ``WorkerError``. Client → engine: ``AddRequest``,
``AbortRequest``, ``Shutdown``; engine → client: ``RequestUpdate`` and, for a serving
frontend, ``StreamUpdates`` (per-step deltas) and ``EngineStats`` (see ``FrontendMessage``).

Top-level messages are msgpack maps tagged by a ``type`` field and carry ``version``, so a peer
built from another revision is rejected with a clear ``WireError`` instead of being
misread. The per-sequence entries of a plan (``SeqPlan``, ``SamplingParams``) are msgpack arrays:
a plan carries hundreds of them and field names would dominate its size.

Block tables travel as diffs: ``BlockTableDiffer`` (engine) sends a request's full table the
first time and only appended blocks afterwards; ``BlockTableMirror`` (worker) rebuilds the
full table from them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Union

import msgspec

from pipeserve.scheduler.sampling_params import SamplingParams

WIRE_VERSION = 7
"""Bumped on every incompatible change of any message below."""

ENGINE_RANK = -1
"""``Heartbeat.rank`` of heartbeats that the engine publishes to the workers."""


class WireError(ValueError):
    """Bytes that are not a valid message of this wire version."""


class _Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag=True):
    # Sent explicitly on every message (the encoder never omits defaults), so a decoder of
    # another version sees the sender's number rather than its own default.
    version: int = WIRE_VERSION


TokenLogprobs = dict[int, tuple[float, int]]
"""One position's logprobs, as the engine hands them out: token id -> (logprob, rank) for the
top-k tokens of the position's distribution in descending order, then the position's own token
(the one sampled there, or the prompt's next token) if it is not among them. A rank is 1 + the
number of tokens of the whole vocabulary with a strictly larger logprob."""


class LogprobRows(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """The logprobs of several positions as the sampling worker computes them, flat: row i holds
    its position's ``num_top`` most likely tokens in descending order, then the position's own
    token, as entries ``i * (num_top + 1) ..`` of ``token_ids``, ``logprobs`` and ``ranks``
    (``TokenLogprobs`` says what a rank is). Flat lists cost the worker one device-to-host copy
    per field; the engine builds each request's entries from them (``entry``)."""

    num_top: int
    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]

    def __post_init__(self) -> None:
        width = self.num_top + 1
        if self.num_top < 0 or len(self.token_ids) % width:
            raise ValueError(f"{len(self.token_ids)} token ids are not rows of num_top + 1 = {width}")
        if not len(self.token_ids) == len(self.logprobs) == len(self.ranks):
            raise ValueError("token_ids, logprobs and ranks differ in length")

    @property
    def num_rows(self) -> int:
        return len(self.token_ids) // (self.num_top + 1)

    def entry(self, row: int, num_top: int) -> TokenLogprobs:
        """Row ``row`` as one position's logprobs, with its first ``num_top`` top tokens."""
        assert 0 <= num_top <= self.num_top, (num_top, self.num_top)
        start = row * (self.num_top + 1)
        own = start + self.num_top
        ids, values, ranks = self.token_ids, self.logprobs, self.ranks
        out = {ids[j]: (values[j], ranks[j]) for j in range(start, start + num_top)}
        out.setdefault(ids[own], (values[own], ranks[own]))
        return out


class PromptLogprobs(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """One prompt chunk's logprobs: ``rows`` row i scores prompt position ``start + i`` (its
    own token is the prompt's token there, given the tokens before it)."""

    request_id: str
    start: int
    rows: LogprobRows


class SeqPlan(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """One request's share of a micro-batch.

    ``new_token_ids`` are the ``num_scheduled_tokens`` tokens this step computes (positions
    ``num_computed_tokens ..``); stage 0 embeds them. A fed decode (``feed_step >= 0``, token
    feedback) has none: its one token is the one step ``feed_step`` samples for this request,
    which stage 0 receives from the last stage (``parallel/feedback.py``). Exactly one of ``block_table`` (full
    table: the workers have not seen this request, or it restarted after preemption) and
    ``block_table_diff`` (blocks appended since the last plan) is set; see ``BlockTableMirror``.
    ``sampling`` is set where the sequence samples, on every chunk of a request whose
    penalties count its prompt too (``repetition_penalty``): the sampling worker keeps the
    tokens of such a request (``runtime/worker/penalties.py``), and on the chunks that score
    prompt tokens. ``prompt_logprob_targets`` (a request with ``sampling.prompt_logprobs``,
    while its prompt is computed) are the prompt tokens that the chunk's leading rows predict:
    the token after each row's position, so the last one of a chunk that ends inside the prompt
    is the next chunk's first.
    """

    request_id: str
    num_computed_tokens: int
    num_scheduled_tokens: int
    new_token_ids: list[int]
    block_table_diff: list[int] | None = None
    block_table: list[int] | None = None
    needs_sample: bool
    sampling: SamplingParams | None
    num_output_tokens: int = 0  # so the sampler can hold EOS back until min_tokens
    feed_step: int = -1
    prompt_logprob_targets: list[int] | None = None

    def __post_init__(self) -> None:
        # Raised inside decode() too, where msgspec turns it into a ValidationError.
        fed = self.feed_step >= 0
        if fed and self.num_scheduled_tokens != 1:
            raise ValueError(f"{self.request_id}: a fed decode schedules one token, not {self.num_scheduled_tokens}")
        if len(self.new_token_ids) != self.num_scheduled_tokens - fed:
            raise ValueError(
                f"{self.request_id}: {len(self.new_token_ids)} new_token_ids for "
                f"{self.num_scheduled_tokens} scheduled tokens" + (" (one fed)" if fed else "")
            )
        if (self.block_table is None) == (self.block_table_diff is None):
            raise ValueError(f"{self.request_id}: set exactly one of block_table, block_table_diff")
        if self.needs_sample and self.sampling is None:
            raise ValueError(f"{self.request_id}: needs_sample without sampling parameters")
        if self.prompt_logprob_targets is not None:
            if self.sampling is None or self.sampling.prompt_logprobs is None:
                raise ValueError(f"{self.request_id}: prompt_logprob_targets without sampling.prompt_logprobs")
            if not 0 < len(self.prompt_logprob_targets) <= self.num_scheduled_tokens - fed:
                raise ValueError(f"{self.request_id}: {len(self.prompt_logprob_targets)} prompt_logprob_targets "
                                 f"for {self.num_scheduled_tokens} scheduled tokens")


class Hello(_Message, frozen=True, kw_only=True):
    """Worker → engine, once its plan subscription is live (see ``transport``)."""

    rank: int
    world_size: int
    stage: int
    tp_rank: int
    pid: int
    hostname: str
    num_kv_blocks: int = 0  # KV blocks this rank can hold (all ranks agree: a min all-reduce)


class Ready(_Message, frozen=True, kw_only=True):
    """Engine → workers, published repeatedly until every worker has said ``Hello``."""

    session: str
    world_size: int


class StepPlan(_Message, frozen=True, kw_only=True):
    """Engine → every worker: one micro-batch.

    ``freed`` lists requests whose state (block-table mirror, sampler state) workers drop
    *before* applying ``seqs``; ``shutdown`` asks workers to exit after this step.
    """

    step_id: int
    seqs: list[SeqPlan]
    freed: list[str] = []
    shutdown: bool = False


class StepResult(_Message, frozen=True, kw_only=True):
    """Last stage (TP rank 0) → engine: one sampled token per sampled request of a step.

    ``logprobs`` row i is ``request_ids[i]``'s (its own token the sampled one), with the top
    tokens of the request that asks for most (a request reads its own
    ``SamplingParams.logprobs`` of them); ``None`` when no request asked for logprobs.
    ``prompt_logprobs``: those of the step's chunks that score prompt tokens
    (``SeqPlan.prompt_logprob_targets``), whether or not the chunk samples.
    """

    step_id: int
    request_ids: list[str]
    token_ids: list[int]
    logprobs: LogprobRows | None = None
    prompt_logprobs: list[PromptLogprobs] = []
    stage_times: list[float] = []
    error: str | None = None

    def __post_init__(self) -> None:
        if len(self.request_ids) != len(self.token_ids):
            raise ValueError(f"step {self.step_id}: request_ids and token_ids differ in length")
        if self.logprobs is not None and self.logprobs.num_rows != len(self.request_ids):
            raise ValueError(f"step {self.step_id}: logprobs and request_ids differ in length")


class StageBusy(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """How long one pipeline stage has computed so far (its TP rank 0 measures it)."""

    stage: int
    busy_s: float
    """Seconds spent computing micro-batches since the worker started, cumulative; on CUDA it
    trails the device by the steps whose end event has not completed yet."""


class Heartbeat(_Message, frozen=True, kw_only=True):
    """Liveness signal; ``t`` is the sender's ``time.time()`` (informational only).

    A worker of TP rank 0 also reports its stage's busy time, so the engine has a live
    per-stage figure (``EngineStats.stage_busy_s``) without a message of its own."""

    rank: int
    t: float
    stage_busy: StageBusy | None = None


class Shutdown(_Message, frozen=True, kw_only=True):
    """Engine → workers: stop now."""

    reason: str


class WorkerError(_Message, frozen=True, kw_only=True):
    """Worker → engine: this rank failed and is exiting."""

    rank: int
    message: str


class AddRequest(_Message, frozen=True, kw_only=True):
    """Client (offline LLM, HTTP frontend) → engine: one sequence to generate.

    ``params`` is validated when decoded (``SamplingParams.__post_init__``)."""

    request_id: str
    prompt_token_ids: list[int]
    prompt: str | None = None
    params: SamplingParams = SamplingParams()
    stream: bool = False
    """Send a ``StreamDelta`` after every step that adds output (in a ``StreamUpdates``);
    otherwise one ``RequestUpdate`` when the request ends."""


class AbortRequest(_Message, frozen=True, kw_only=True):
    """Client → engine: stop a request and free its KV blocks."""

    request_id: str


class RequestTimings(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """A finished request's latencies in seconds, measured by the engine from its arrival, and
    its token counts."""

    queue_s: float | None
    """Arrival to first scheduled (scheduling delay); None if never scheduled."""
    ttft_s: float | None
    """Arrival to first output token; None if it produced none."""
    e2e_s: float
    """Arrival to finish."""
    tbt_s: list[float] = []
    """Gaps between consecutive output tokens (time between tokens)."""
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens whose KV the prefix cache held at the request's first admission."""


class RequestUpdate(_Message, frozen=True, kw_only=True):
    """Engine → client: a request's output so far (``finish_reason`` set when it ended;
    "error" with ``error`` when it was rejected or its workers failed)."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """With ``SamplingParams.prompt_logprobs``: one entry per prompt token, the first None."""
    error: str | None = None
    timings: RequestTimings | None = None


class StreamDelta(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """What one streaming request gained since its previous delta: the deltas of a request,
    concatenated, are its whole output. Text that a stop string may still cut is held back
    until it can no longer be cut, so ``text`` is never retracted."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """In a request's first delta only (``RequestUpdate.prompt_logprobs``)."""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    timings: RequestTimings | None = None


class StreamUpdates(_Message, frozen=True, kw_only=True):
    """Engine → client (serving): the deltas of every streaming request one step advanced."""

    deltas: list[StreamDelta]


class EngineStats(_Message, frozen=True, kw_only=True):
    """Engine → client (serving), periodically and when the engine goes idle."""

    num_waiting: int
    num_running: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    stage_busy_s: list[float] = []
    """Per pipeline stage, seconds spent computing micro-batches since the engine started
    (cumulative, as last reported by the stage); empty where the engine cannot measure it."""
    active_s: float = 0.0
    """Seconds the engine has had unfinished requests since it started (cumulative): the
    wall time against which stage busy time gives the bubble fraction, 1 - busy/active."""
    draining: bool = False
    """The engine got SIGTERM: it takes no new requests and exits once the last one ends."""
    failed: str | None = None
    """The engine lost its workers (why): every request has ended with an error and the engine
    is shutting down; the frontend turns unhealthy at once rather than when the process exits."""
    num_rejected: int = 0
    """Control-plane connections refused (they did not hold the run's key) and frames dropped
    as malformed, on the engine's sockets and its workers', since the engine started."""
    num_preemptions: int = 0
    """Requests preempted (to be recomputed) since the engine started."""
    num_prefix_cache_queries: int = 0
    """Prompt tokens looked up in the prefix cache at first admissions since the engine started."""
    num_prefix_cache_hits: int = 0
    """Of those, tokens the cache held."""


Message = Union[
    Hello, Ready, StepPlan, StepResult, Heartbeat, Shutdown, WorkerError,
    AddRequest, AbortRequest, RequestUpdate,
]

FrontendMessage = Union[RequestUpdate, StreamUpdates, EngineStats]
"""What a serving client (the HTTP frontend) reads from the engine's updates socket. The
offline client (``EngineClient``) never asks for streams or stats, so it only sees
``RequestUpdate`` and may keep decoding with ``decode``."""

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_frontend_decoder = msgspec.msgpack.Decoder(FrontendMessage)


def encode(msg: Message) -> bytes:
    """Serialize one message (msgpack)."""
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    """Parse one message; raise ``WireError`` on garbage, unknown types or another version."""
    return _decode(_decoder, data)


def decode_frontend(data: bytes) -> FrontendMessage:
    """``decode`` for the messages a serving client reads (``FrontendMessage``)."""
    return _decode(_frontend_decoder, data)


def _decode(decoder: msgspec.msgpack.Decoder, data: bytes):
    try:
        msg = decoder.decode(data)
    except msgspec.DecodeError as exc:
        # A newer peer may fail validation before its version is looked at; report the
        # version, which is the actual cause, when it can be read.
        _check_version(_peek_version(data))
        raise WireError(f"malformed message: {exc}") from exc
    _check_version(msg.version)
    return msg


def _peek_version(data: bytes) -> int | None:
    try:
        raw = msgspec.msgpack.decode(data)
    except msgspec.DecodeError:
        return None
    return raw.get("version") if isinstance(raw, dict) else None


def _check_version(version: object) -> None:
    if version is not None and version != WIRE_VERSION:
        raise WireError(
            f"wire version {version!r} from peer, this build speaks {WIRE_VERSION}: "
            "engine and workers must run the same pipeserve"
        )


class BlockTableDiffer:
    """Engine side: decides per request whether a plan carries its full table or a diff.

    Remembers only how much of each table was sent and its last block, so a step costs O(new
    blocks) rather than O(table). Call ``forget`` when a request finishes or is preempted (a
    restarted request gets new blocks and must be sent in full again).
    """

    def __init__(self) -> None:
        self._sent: dict[str, tuple[int, int]] = {}  # request id -> (length, last block)

    def plan_for(
        self, request_id: str, table: list[int]
    ) -> tuple[list[int] | None, list[int] | None]:
        """Return ``(full, None)`` or ``(None, diff)`` for this step's ``SeqPlan``."""
        sent = self._sent.get(request_id)
        if table:
            self._sent[request_id] = (len(table), table[-1])
        else:
            self._sent.pop(request_id, None)
        if sent is None or not _extends(table, sent):
            return list(table), None
        return None, table[sent[0]:]

    def forget(self, request_id: str) -> None:
        """Drop a request (finished, aborted or preempted); unknown ids are ignored."""
        self._sent.pop(request_id, None)


def _extends(table: list[int], sent: tuple[int, int]) -> bool:
    # Block tables only grow while a request lives; anything else is sent in full, which
    # the mirror takes as a replacement, so the two sides cannot drift apart.
    length, last = sent
    return len(table) >= length and table[length - 1] == last


class BlockTableMirror:
    """Worker side: the engine's block table of every live request, rebuilt from plans."""

    def __init__(self) -> None:
        self._tables: dict[str, list[int]] = {}

    def apply(self, seq: SeqPlan) -> list[int]:
        """Apply one ``SeqPlan``; return the request's full table (the mirror's own: read only)."""
        if seq.block_table is not None:
            table = self._tables[seq.request_id] = list(seq.block_table)
            return table
        table = self._tables.get(seq.request_id)
        if table is None:
            raise WireError(f"block-table diff for unknown request {seq.request_id!r}")
        table.extend(seq.block_table_diff or ())
        return table

    def apply_plan(self, plan: StepPlan) -> list[list[int]]:
        """Drop ``plan.freed``, then apply every seq; return their tables in ``plan.seqs`` order."""
        self.free(plan.freed)
        return [self.apply(seq) for seq in plan.seqs]

    def free(self, request_ids: Iterable[str]) -> None:
        """Forget requests; ids never seen (aborted before their first step) are ignored."""
        for request_id in request_ids:
            self._tables.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._tables

    def __len__(self) -> int:
        return len(self._tables)
