"""Logits processing before sampling: allowed_token_ids, bad_words, logit_bias, and the
repetition, frequency and presence penalties, for a whole batch with tensor ops on the logits'
device (vLLM v1's order and formulas).

The penalties and multi-token bad words look at a request's tokens. The sampling worker keeps
them in a ``TokenHistory``: the tokens of each request that needs them, by position, in one
device tensor. Positions make it exact under every way a token reaches the worker: a plan's
prompt chunk or decode input writes its tokens where they sit, a recomputed request (after
preemption) writes the same tokens again, and the token a step samples is written at the
position after the step's last one, on the device, so that a fed decode (token feedback,
planned before its input is back) finds it without the host waiting for it. Which positions
are output is known from the plan: a sampling sequence of ``num_output_tokens`` outputs and
context ``num_computed_tokens + num_scheduled_tokens`` has a prompt of the difference.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pipeserve.parallel.wire import SeqPlan, StepPlan
from pipeserve.runtime.worker.batch import host_to_device
from pipeserve.scheduler.sampling_params import SamplingParams


@dataclass(slots=True)
class HistoryRows:
    """What the sampler reads of a batch's token history: per sampled row, its row of
    ``tokens`` (-1: the request keeps none), its context length and its prompt length."""

    tokens: torch.Tensor  # [R, capacity] int64 on the sampling device
    rows: list[int]
    context_lens: list[int]
    prompt_lens: list[int]

    def __getitem__(self, rows: slice) -> HistoryRows:
        return HistoryRows(self.tokens, self.rows[rows], self.context_lens[rows], self.prompt_lens[rows])


class TokenHistory:
    """Per request that ``needs_token_history``, its tokens by position on ``device``; a request
    is dropped when a plan frees it. Grows by doubling (rows and positions)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.tokens = torch.zeros(0, 0, dtype=torch.int64, device=device)  # [R, capacity]
        self._rows: dict[str, int] = {}
        self._free_rows: list[int] = []

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    def apply_plan(self, plan: StepPlan) -> None:
        """Drops ``plan.freed``; writes the tokens the plan carries for every request that
        needs them (``SeqPlan.sampling`` says so)."""
        for rid in plan.freed:
            if (row := self._rows.pop(rid, None)) is not None:
                self._free_rows.append(row)
        seqs = [s for s in plan.seqs if s.sampling is not None and s.sampling.needs_token_history]
        if not seqs:
            return
        rows = [self._row(s.request_id) for s in seqs]
        self._reserve(max(s.num_computed_tokens + s.num_scheduled_tokens for s in seqs) + 1)
        lens = [len(s.new_token_ids) for s in seqs]
        if sum(lens) == 0:  # fed decodes only: their inputs are here already
            return
        where = np.empty((3, sum(lens)), dtype=np.int64)  # row, position, token
        where[0] = np.repeat(rows, lens)
        where[1] = np.concatenate([np.arange(s.num_computed_tokens, s.num_computed_tokens + n)
                                   for s, n in zip(seqs, lens)])
        where[2] = np.concatenate([s.new_token_ids for s in seqs])
        where_t = host_to_device(where, torch.int64, self.device)
        self.tokens.index_put_((where_t[0], where_t[1]), where_t[2])

    def rows_of(self, seqs: Sequence[SeqPlan]) -> HistoryRows | None:
        """The history of a step's sampled sequences; None when none keeps one."""
        rows = [self._rows.get(s.request_id, -1) for s in seqs]
        if all(r < 0 for r in rows):
            return None
        context_lens = [s.num_computed_tokens + s.num_scheduled_tokens for s in seqs]
        prompt_lens = [n - s.num_output_tokens for n, s in zip(context_lens, seqs)]
        return HistoryRows(self.tokens, rows, context_lens, prompt_lens)

    def append_sampled(self, history: HistoryRows, token_ids: torch.Tensor) -> None:
        """Writes each tracked row's sampled token (``token_ids``: [N] on the device) after its
        context, without waiting for the device."""
        index = [(i, r, n) for i, (r, n) in enumerate(zip(history.rows, history.context_lens)) if r >= 0]
        where = host_to_device(list(zip(*index)), torch.int64, self.device)  # [3, M]: batch row, row, position
        self.tokens.index_put_((where[1], where[2]), token_ids.index_select(0, where[0]))

    def _row(self, request_id: str) -> int:
        row = self._rows.get(request_id)
        if row is None:
            row = self._free_rows.pop() if self._free_rows else len(self._rows)
            self._rows[request_id] = row
        return row

    def _reserve(self, capacity: int) -> None:
        num_rows, width = self.tokens.shape
        need_rows = len(self._rows) + len(self._free_rows)
        if need_rows <= num_rows and capacity <= width:
            return
        grown = torch.zeros(max(need_rows, 2 * num_rows if need_rows > num_rows else num_rows),
                            max(capacity, 2 * width if capacity > width else width),
                            dtype=torch.int64, device=self.device)
        grown[:num_rows, :width] = self.tokens
        self.tokens = grown


def process_logits(logits: torch.Tensor, params: Sequence[SamplingParams],
                   history: HistoryRows | None) -> torch.Tensor:
    """``logits`` with, in each row, allowed_token_ids, bad_words, logit_bias, then the
    repetition, frequency and presence penalties applied (vLLM v1's order); ``logits`` itself
    (unchanged) when no row uses any. ``history``: the rows' token history (needed where a
    row ``needs_token_history``)."""
    # logits: [n, V] float32
    if not any(p.processes_logits for p in params):
        return logits
    out = logits.clone()
    _apply_allowed_token_ids(out, params)
    _apply_bad_words(out, params, history)
    _apply_logit_bias(out, params)
    _apply_penalties(out, params, history)
    return out


def _apply_allowed_token_ids(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    rows = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
    if not rows:
        return
    vocab_size = logits.shape[1]
    ids = [[t for t in params[i].allowed_token_ids if t < vocab_size] for i in rows]
    where = np.stack([np.repeat(np.arange(len(rows)), list(map(len, ids))), np.concatenate(ids)])
    where = host_to_device(where, torch.int64, logits.device)  # [2, M]: row among `rows`, token
    allowed = torch.zeros(len(rows), vocab_size, dtype=torch.bool, device=logits.device)
    allowed[where[0], where[1]] = True
    index = host_to_device(rows, torch.int64, logits.device)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(allowed.logical_not_(), float("-inf")))


def _apply_bad_words(logits: torch.Tensor, params: Sequence[SamplingParams], history: HistoryRows | None) -> None:
    """A bad word's last token is banned where its other tokens end the output (at once for a
    word of one token); a word longer than the output + 1 tokens cannot match (vLLM)."""
    vocab_size = logits.shape[1]
    banned: list[tuple[int, int]] = []  # (row, token), always
    pending: list[tuple[int, list[int]]] = []  # (row, word) to match against the output's end
    for i, p in enumerate(params):
        for word in p._bad_words_token_ids or ():
            if word[-1] >= vocab_size:
                continue
            if len(word) == 1:
                banned.append((i, word[0]))
                continue
            assert history is not None and history.rows[i] >= 0, "a bad word of several tokens needs the history"
            if len(word) - 1 <= history.context_lens[i] - history.prompt_lens[i]:
                pending.append((i, word))
    if banned:
        where = host_to_device(list(zip(*banned)), torch.int64, logits.device)
        logits.index_put_((where[0], where[1]), torch.tensor(float("-inf"), device=logits.device))
    if pending:
        _ban_matching(logits, pending, history)


def _ban_matching(logits: torch.Tensor, pending: list[tuple[int, list[int]]], history: HistoryRows) -> None:
    width = max(len(word) - 1 for _, word in pending)
    # Per (row, word): the positions of the output's last `width` tokens and the prefix
    # expected there, right-aligned; -1 pads the columns before a shorter prefix.
    info = np.full((len(pending), 3 + 2 * width), -1, dtype=np.int64)
    for k, (i, word) in enumerate(pending):
        prefix = word[:-1]
        info[k, :3] = (i, history.rows[i], word[-1])
        info[k, 3 + width - len(prefix): 3 + width] = prefix
        info[k, 3 + width:] = np.arange(history.context_lens[i] - width, history.context_lens[i])
    info_t = host_to_device(info, torch.int64, logits.device)
    rows, expected, positions = info_t[:, 1:2], info_t[:, 3:3 + width], info_t[:, 3 + width:]
    seen = history.tokens[rows, positions.clamp(min=0)]  # [K, width]
    match = ((seen == expected) | (expected < 0)).all(dim=1)  # [K]
    ban = torch.zeros(len(pending), device=logits.device).masked_fill_(match, float("-inf"))
    logits.index_put_((info_t[:, 0], info_t[:, 2]), ban, accumulate=True)


def _apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    vocab_size = logits.shape[1]
    entries = [(i, t, b) for i, p in enumerate(params) for t, b in (p.logit_bias or {}).items() if t < vocab_size]
    if not entries:
        return
    rows, ids, bias = zip(*entries)
    where = host_to_device([rows, ids], torch.int64, logits.device)
    logits.index_put_((where[0], where[1]), host_to_device(bias, torch.float32, logits.device), accumulate=True)


def _apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams], history: HistoryRows | None) -> None:
    """Repetition over the prompt and output tokens (a positive logit divided by it, another
    multiplied), then ``frequency * count + presence * (count > 0)`` over the output's counts."""
    rows = [i for i, p in enumerate(params) if p.uses_penalties]
    if not rows:
        return
    assert history is not None and min(history.rows[i] for i in rows) >= 0, "penalties need the history"
    device, (_, vocab_size) = logits.device, logits.shape
    context_lens = [history.context_lens[i] for i in rows]
    columns = [[history.rows[i] for i in rows], context_lens, [history.prompt_lens[i] for i in rows]]
    index_rows, context, prompt = host_to_device(columns, torch.int64, device).split(1)  # 3 x [1, m]
    settings = [[params[i].repetition_penalty, params[i].frequency_penalty, params[i].presence_penalty]
                for i in rows]
    repetition, frequency, presence = host_to_device(settings, torch.float32, device).split(1, dim=1)  # [m, 1]
    positions = torch.arange(max(context_lens), device=device)  # [L]
    tokens = history.tokens[index_rows.view(-1, 1), positions]  # [m, L]
    in_context = positions < context.view(-1, 1)  # [m, L]
    is_output = in_context & (positions >= prompt.view(-1, 1))
    # Tokens outside what is counted land in an extra column, dropped after.
    counts = torch.zeros(len(rows), vocab_size + 1, device=device)
    counts.scatter_add_(1, tokens.where(is_output, vocab_size), torch.ones_like(tokens, dtype=counts.dtype))
    seen = torch.zeros(len(rows), vocab_size + 1, dtype=torch.bool, device=device)
    seen.scatter_(1, tokens.where(in_context, vocab_size), True)
    counts, seen = counts[:, :vocab_size], seen[:, :vocab_size]  # [m, V]
    index = host_to_device(rows, torch.int64, device)
    x = logits.index_select(0, index)  # [m, V]
    factor = torch.where(seen, repetition, 1.0)
    x = torch.where(x > 0, x / factor, x * factor)
    x -= frequency * counts + presence * (counts > 0)
    logits.index_copy_(0, index, x)
