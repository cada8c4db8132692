"""Structured outputs (guided decoding) with xgrammar: a request's JSON schema, regex, choice or
EBNF grammar becomes a token mask each step. xgrammar rather than outlines-core, which expresses
regular languages only (no json_object, no EBNF), compiles schemas far more slowly and costs more
per token on average (``python -m tools.grammar_overhead`` compares the two).

The engine compiles a request's constraint when it adds the request (``GrammarCompiler.compile``:
a bad schema, regex or grammar is a ValueError there, before anything is scheduled). The spec
itself travels in the request's ``SamplingParams``; the sampling worker compiles it again
through the same cache (keyed by the spec; one compiler per process, so an in-process worker
reuses the engine's result, and a distributed driver compiles each distinct spec once).

The driver keeps one ``GrammarMatcher`` per constrained request (``GrammarState``). Each step,
on the host, it fills one bitmask row per constrained row of the batch, all rows at once
(xgrammar's ``batch_fill_next_token_bitmask``), and copies them to the device (``bitmask``); the sampler applies them there
(``apply_token_bitmask``); the whole batch's sampled ids are copied to the host behind the
sampler (``accept_later``) and each matcher accepts its row's token when the next mask is
filled. The host fills a step's bitmask after that step's forward was launched: on an
accelerator the fill, and the wait for the previous step's ids it needs first, overlap that
forward, and nothing in between waits for the device, so a step with constrained rows keeps the
engine's asynchronous schedule. Matchers are advanced by the worker that sampled the tokens, so a
decode planned before its input reached the engine (pipelining, token feedback) still finds its
matcher up to date. A preempted request recomputes its output as prompt and samples again from
output number ``num_output_tokens``: a matcher that accepted more tokens than that is reset and
re-advanced over the kept ones.
"""

from __future__ import annotations

import bisect
import functools
import json
import re
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from pipeserve.parallel.wire import SeqPlan, StepPlan
from pipeserve.runtime.worker.batch import host_to_device
from pipeserve.scheduler.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr

FILL_THREADS = 1
"""xgrammar's threads for one step's masks: one. A row fills in a few µs (up to a hundred on a
128k vocabulary), less than handing rows to more threads costs (``python -m tools.grammar_steps
batch --threads 1,2,4,8`` times each)."""
_ERROR_PREFIX = re.compile(r"^\[[^\]]*\] [^ ]*: (Check failed: \(.*\) is false: )?")


def _xgrammar():
    """xgrammar, imported on first use: it imports transformers (about 1.5 s on a 2-core CPU),
    which a process serving no structured output (every worker, until one comes) never needs."""
    import xgrammar

    return xgrammar


class GrammarCompiler:
    """Compiles constraints for one tokenizer; results are cached by spec."""

    def __init__(self, tokenizer, *, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        """``tokenizer``: pipeserve's; ``vocab_size``: the model's logits width (may exceed the
        tokenizer's); EOS ends a finished constraint."""
        xgr = _xgrammar()
        encoded = [""] * vocab_size
        for text, token_id in tokenizer.backend.get_vocab(with_added_tokens=True).items():
            if token_id < vocab_size:
                encoded[token_id] = text
        vocab_type, add_prefix_space = _vocab_encoding(tokenizer.backend)
        info = xgr.TokenizerInfo(encoded, vocab_type, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids),
                                 add_prefix_space=add_prefix_space)
        self.vocab_size = vocab_size
        self.stop_token_ids = list(eos_token_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._compile = functools.lru_cache(maxsize=256)(self._compile_key)

    def compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled constraint; ValueError naming the problem where it does not compile."""
        return self._compile(spec.key)

    def _compile_key(self, key: tuple[str, str]) -> xgr.CompiledGrammar:
        kind, text = key
        try:
            if kind == "json":
                return self._compiler.compile_json_schema(text)
            if kind == "json_object":
                return self._compiler.compile_builtin_json_grammar()
            if kind == "regex":
                return self._compiler.compile_regex(text)
            if kind == "choice":
                return self._compiler.compile_grammar(_choice_grammar(text))
            return self._compiler.compile_grammar(text)
        except RuntimeError as e:
            message = _ERROR_PREFIX.sub("", str(e).strip().splitlines()[0])
            raise ValueError(f"invalid structured output {kind}: {message}") from None


def _vocab_encoding(backend) -> tuple[xgr.VocabType, bool]:
    """How the vocabulary spells bytes (its decoder says: GPT-2's byte-level alphabet, or
    SentencePiece's ``<0xNN>`` byte fallback with ``▁`` for spaces), and whether the encoder
    prepends a space."""
    xgr = _xgrammar()
    spec = json.loads(backend.to_str())
    decoder = json.dumps(spec.get("decoder"))
    if "ByteLevel" in decoder:
        return xgr.VocabType.BYTE_LEVEL, False
    if "ByteFallback" in decoder:
        pre = json.dumps(spec.get("normalizer")) + json.dumps(spec.get("pre_tokenizer"))
        return xgr.VocabType.BYTE_FALLBACK, '"Prepend"' in pre or '"prepend_scheme": "always"' in pre
    return xgr.VocabType.RAW, False


def _choice_grammar(choices_json: str) -> str:
    """EBNF whose sentences are the choices (``choices_json``: their JSON list, whose string
    literals are valid EBNF ones)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(choices_json))


@dataclass(frozen=True, slots=True)
class TokenBitmask:
    """One step's structured-output masks: a row of bits for each constrained row of the batch."""

    rows: list[int]
    """The constrained rows of the batch, ascending."""
    index: torch.Tensor
    """[K] int64 on the logits' device: ``rows``."""
    bits: torch.Tensor
    """[K, ceil(V / 32)] int32 on the logits' device: bit t of row k set where batch row
    ``rows[k]`` may sample token t (only EOS where the constraint is complete and accepted
    EOS already)."""


@dataclass(slots=True)
class _Matched:
    matcher: xgr.GrammarMatcher
    accepted: list[int] = field(default_factory=list)


class GrammarState:
    """The driver's matchers, one per constrained request; a request is dropped when a plan
    frees it."""

    def __init__(self, compiler: GrammarCompiler, device: torch.device) -> None:
        """``device``: the logits' (masks go there; on CUDA they are filled in pinned memory)."""
        self.compiler = compiler
        self.device = device
        self._matched: dict[str, _Matched] = {}
        xgr = _xgrammar()
        self._filler = xgr.BatchGrammarMatcher(FILL_THREADS)
        self._width = xgr.get_bitmask_shape(1, compiler.vocab_size)[1]
        self._eos_only = torch.zeros(self._width, dtype=torch.int32)
        for t in compiler.stop_token_ids:
            self._eos_only[t // 32] |= _bit(t)
        # The batches' sampled ids on their way to the host, oldest first:
        # (request ids, their rows, [N] ids, CUDA event).
        self._pending: deque[tuple[list[str], list[int], torch.Tensor, torch.cuda.Event | None]] = deque()

    def __len__(self) -> int:
        return len(self._matched)

    def apply_plan(self, plan: StepPlan) -> None:
        for rid in plan.freed:
            self._matched.pop(rid, None)

    def bitmask(self, seqs: Sequence[SeqPlan]) -> TokenBitmask | None:
        """The constrained rows' masks on ``device`` (copied there without waiting for the
        device); None when no row is constrained."""
        rows = [i for i, s in enumerate(seqs) if s.sampling.structured_outputs is not None]
        if not rows:
            return None
        self._accept_arrived()
        matchers = [self._state_of(seqs[i]).matcher for i in rows]
        bits = torch.empty(len(rows), self._width, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        live = [k for k, m in enumerate(matchers) if not m.is_terminated()]
        if len(live) < len(rows):  # steps planned before the EOS reached the engine
            bits[:] = self._eos_only
        if live:
            self._filler.batch_fill_next_token_bitmask([matchers[k] for k in live], bits,
                                                       None if len(live) == len(rows) else live)
        return TokenBitmask(rows=rows, index=host_to_device(rows, torch.int64, self.device),
                            bits=host_to_device(bits, torch.int32, self.device))

    def accept(self, seqs: Sequence[SeqPlan], token_ids: torch.Tensor) -> None:
        """Advances each constrained row's matcher by its sampled token (``token_ids``: [N])."""
        self.accept_later(seqs, token_ids)
        self._accept_arrived()

    def accept_later(self, seqs: Sequence[SeqPlan], token_ids: torch.Tensor) -> None:
        """Notes the constrained rows' sampled tokens (``token_ids``: [N] on the sampling
        device) without waiting for them: on CUDA the whole batch's ids are copied to pinned
        memory behind the sampler (no index to build on the device: a copy of one from the
        host would wait for the stream), and the matchers take them when the next mask is
        filled (``bitmask``). That next step's forward is queued by then, so the host waits for
        this step's ids while the device computes the next one, and the engine's asynchronous
        schedule (token feedback) holds with constrained rows too."""
        rows = [i for i, s in enumerate(seqs) if s.sampling.structured_outputs is not None]
        if not rows:
            return
        event = None
        if token_ids.is_cuda:
            host = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
            host.copy_(token_ids, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            token_ids = host
        self._pending.append(([seqs[i].request_id for i in rows], rows, token_ids, event))

    def _accept_arrived(self) -> None:
        """Advances the matchers by every noted step's tokens, in step order."""
        while self._pending:
            request_ids, rows, tokens, event = self._pending.popleft()
            if event is not None:
                event.synchronize()
            tokens = tokens.tolist()
            for rid, row in zip(request_ids, rows):
                state = self._matched.get(rid)
                if state is None or state.matcher.is_terminated():  # (freed since, or past its end)
                    continue
                token = tokens[row]
                accepted = state.matcher.accept_token(token)
                assert accepted, f"{rid}: sampled token {token} that the grammar rejects"
                state.accepted.append(token)

    def _state_of(self, seq: SeqPlan) -> _Matched:
        """The request's matcher, advanced over exactly its ``num_output_tokens`` outputs."""
        state = self._matched.get(seq.request_id)
        if state is None:
            compiled = self.compiler.compile(seq.sampling.structured_outputs)
            state = self._matched[seq.request_id] = _Matched(_xgrammar().GrammarMatcher(compiled))
        assert seq.num_output_tokens <= len(state.accepted), (
            f"{seq.request_id}: output {seq.num_output_tokens} sampled before its matcher saw the earlier ones")
        if seq.num_output_tokens < len(state.accepted):  # preempted: outputs after this one were dropped
            kept = state.accepted[:seq.num_output_tokens]
            state.matcher.reset()
            state.accepted = []
            for token in kept:
                assert state.matcher.accept_token(token)
                state.accepted.append(token)
        return state


def _bit(token: int) -> int:
    """Token ``token``'s bit in its int32 word (bit 31 as a negative int32)."""
    return int(np.int32(np.uint32(1 << (token % 32)).view(np.int32)))


def apply_token_bitmask(logits: torch.Tensor, bitmask: TokenBitmask, rows: slice) -> torch.Tensor:
    """``logits``, rows ``rows`` of the step's batch, with -inf where a constrained row's bit is
    clear: a copy (logprobs stay the raw logits') where some row of them is constrained, else
    ``logits`` itself. By xgrammar's kernel on the logits' device, over the slice's rows, the
    unconstrained ones given every bit on the device: one full-width kernel costs less than
    unpacking the mask with torch ops or masking the constrained rows apart."""
    # logits: [n, V]; bitmask.bits: [K, W] int32, W = ceil(V / 32)
    first, end = bisect.bisect_left(bitmask.rows, rows.start), bisect.bisect_left(bitmask.rows, rows.stop)
    if first == end:
        return logits
    bits = bitmask.bits[first:end]
    if end - first < logits.shape[0]:
        index = bitmask.index[first:end]
        if rows.start:
            index = index - rows.start
        bits = bits.new_full((logits.shape[0], bits.shape[1]), -1).index_copy_(0, index, bits)  # [n, W]
    out = logits.clone()
    _xgrammar().apply_token_bitmask_inplace(out, bits)
    return out
