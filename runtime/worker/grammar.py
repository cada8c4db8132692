"""Structured outputs (guided decoding) with xgrammar: a request's JSON schema, regex, choice or
EBNF grammar becomes a token mask each step.

The engine compiles a request's constraint when it adds the request (``GrammarCompiler.compile``:
a bad schema, regex or grammar is a ValueError there, before anything is scheduled). The spec
itself travels in the request's ``SamplingParams``; the sampling worker compiles it again
through the same cache (keyed by the spec; one compiler per process, so an in-process worker
reuses the engine's result, and a distributed driver compiles each distinct spec once).

The driver keeps one ``GrammarMatcher`` per constrained request (``GrammarState``). Each step,
on the host, it fills the token bitmask of the constrained rows (``bitmask``) and the sampler
applies it to the whole batch on the logits' device at once (``apply_token_bitmask``); the
sampled ids are copied to the host behind the sampler (``accept_later``) and each matcher
accepts its row's token when the next mask is filled. The host fills a step's bitmask after that
step's forward was launched: on an accelerator the fill, and the wait for the previous step's
ids it needs first, overlap that forward, so a step with constrained rows keeps the engine's
asynchronous schedule. Matchers are advanced by the worker that sampled the tokens, so a
decode planned before its input reached the engine (pipelining, token feedback) still finds its
matcher up to date. A preempted request recomputes its output as prompt and samples again from
output number ``num_output_tokens``: a matcher that accepted more tokens than that is reset and
re-advanced over the kept ones.
"""

from __future__ import annotations

import functools
import json
import re
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import xgrammar as xgr

from pipeserve.parallel.wire import SeqPlan, StepPlan
from pipeserve.scheduler.sampling_params import StructuredOutputsParams

_ERROR_PREFIX = re.compile(r"^\[[^\]]*\] [^ ]*: (Check failed: \(.*\) is false: )?")


class GrammarCompiler:
    """Compiles constraints for one tokenizer; results are cached by spec."""

    def __init__(self, tokenizer, *, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        """``tokenizer``: pipeserve's; ``vocab_size``: the model's logits width (may exceed the
        tokenizer's); EOS ends a finished constraint."""
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


@dataclass(slots=True)
class _Matched:
    matcher: xgr.GrammarMatcher
    accepted: list[int] = field(default_factory=list)


class GrammarState:
    """The driver's matchers, one per constrained request; a request is dropped when a plan
    frees it."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._matched: dict[str, _Matched] = {}
        # Sampled ids on their way to the host, oldest first: (request ids, [n] ids, CUDA event).
        self._pending: deque[tuple[list[str], torch.Tensor, torch.cuda.Event | None]] = deque()

    def __len__(self) -> int:
        return len(self._matched)

    def apply_plan(self, plan: StepPlan) -> None:
        for rid in plan.freed:
            self._matched.pop(rid, None)

    def bitmask(self, seqs: Sequence[SeqPlan]) -> torch.Tensor | None:
        """[N, ceil(V / 32)] int32 on the host, bit t of row i set where row i may sample token
        t (every bit in unconstrained rows; only EOS where the constraint is complete and
        accepted EOS already); None when no row is constrained."""
        rows = [i for i, s in enumerate(seqs) if s.sampling.structured_outputs is not None]
        if not rows:
            return None
        self._accept_arrived()
        mask = xgr.allocate_token_bitmask(len(seqs), self.compiler.vocab_size)  # all bits set
        for i in rows:
            state = self._state_of(seqs[i])
            if state.matcher.is_terminated():  # a step planned before the EOS reached the engine
                mask[i] = 0
                for t in self.compiler.stop_token_ids:
                    mask[i, t // 32] |= _bit(t)
            else:
                state.matcher.fill_next_token_bitmask(mask, i)
        return mask

    def accept(self, seqs: Sequence[SeqPlan], token_ids: torch.Tensor) -> None:
        """Advances each constrained row's matcher by its sampled token (``token_ids``: [N])."""
        self.accept_later(seqs, token_ids)
        self._accept_arrived()

    def accept_later(self, seqs: Sequence[SeqPlan], token_ids: torch.Tensor) -> None:
        """Notes the constrained rows' sampled tokens (``token_ids``: [N] on the sampling
        device) without waiting for them: on CUDA they are copied to pinned memory behind the
        sampler, and the matchers take them when the next mask is filled (``bitmask``). That
        next step's forward is queued by then, so the host waits for this step's ids while the
        device computes the next one, and the engine's asynchronous schedule (token feedback)
        holds with constrained rows too."""
        rows = [i for i, s in enumerate(seqs) if s.sampling.structured_outputs is not None]
        if not rows:
            return
        chosen = token_ids.index_select(0, torch.tensor(rows, device=token_ids.device))
        event = None
        if chosen.is_cuda:
            host = torch.empty(chosen.shape, dtype=chosen.dtype, pin_memory=True)
            host.copy_(chosen, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            chosen = host
        self._pending.append(([seqs[i].request_id for i in rows], chosen, event))

    def _accept_arrived(self) -> None:
        """Advances the matchers by every noted step's tokens, in step order."""
        while self._pending:
            request_ids, tokens, event = self._pending.popleft()
            if event is not None:
                event.synchronize()
            for rid, token in zip(request_ids, tokens.tolist()):
                state = self._matched.get(rid)
                if state is None or state.matcher.is_terminated():  # (freed since, or past its end)
                    continue
                accepted = state.matcher.accept_token(token)
                assert accepted, f"{rid}: sampled token {token} that the grammar rejects"
                state.accepted.append(token)

    def _state_of(self, seq: SeqPlan) -> _Matched:
        """The request's matcher, advanced over exactly its ``num_output_tokens`` outputs."""
        state = self._matched.get(seq.request_id)
        if state is None:
            compiled = self.compiler.compile(seq.sampling.structured_outputs)
            state = self._matched[seq.request_id] = _Matched(xgr.GrammarMatcher(compiled))
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


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """A copy of ``logits`` with -inf where the row's bit is clear, by xgrammar's own kernel on
    the logits' device (its CPU one took 19 ms for 32 rows of 49,152 against 76 ms for the same
    mask unpacked with torch ops, on this project's 2-core CI machine; a copy, so logprobs stay
    the raw logits')."""
    # logits: [n, V]; bitmask: [n, W] int32 on the logits' device, W = ceil(V / 32)
    out = logits.clone()
    xgr.apply_token_bitmask_inplace(out, bitmask)
    return out
