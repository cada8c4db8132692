"""Turn one step's logits into next tokens: greedy, or temperature + top-k + top-p + min-p.

Rows that ask for them first have their logits processed: the structured-output token mask
(``grammar.apply_token_bitmask``, a step with constrained rows only), then
``penalties.process_logits`` (allowed_token_ids, bad_words, logit_bias,
repetition/frequency/presence penalties), then the min_tokens mask; rows that ask for none cost
nothing there.

The batch is processed on the logits' device, with a few host->device copies of the per-row
settings and one device->host copy of the chosen ids (plus three of the logprobs when a row asks
for them: ``compute_logprobs``, which the prompt's logprobs use too). On the CPU it goes in
chunks of rows whose working buffers stay in cache; elsewhere in one piece. Greedy rows take
the argmax of the raw logits; the others are filtered and sampled.

Every filter keeps the tokens whose logit is at or above some value, so the filters of a row
combine into one threshold. Top-k and top-p find theirs among the row's largest logits
(``torch.topk``), never sorting the whole vocabulary unless top-p's nucleus does not fit in the
candidates tried first (on the CPU), or on an accelerator, where sorting is cheap and choosing
the rows that need it would wait for the device.

Random rows sample by an exponential race, ``argmax(probs / q)`` with ``q ~ Exp(1)``, which
draws token i with probability probs[i] / sum(probs) (no renormalization needed). The race is
run in two rounds over blocks of ``_BLOCK_SIZE`` tokens: first between the blocks, each entering
with its total probability, then within the winning block. A race between groups picks each
group with probability proportional to its mass, as often as the group holds the winner of the
race between all tokens, so the token keeps its distribution while a row draws
ceil(V / _BLOCK_SIZE) + _BLOCK_SIZE numbers instead of V. A row with a generator fills its own
``q`` from that generator only, the same count every step, so a seeded request produces the same
tokens whatever else shares its batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipeserve.parallel.wire import LogprobRows
from pipeserve.runtime.worker.batch import host_to_device
from pipeserve.runtime.worker.grammar import TokenBitmask, apply_token_bitmask
from pipeserve.runtime.worker.penalties import HistoryRows, process_logits
from pipeserve.scheduler.sampling_params import SamplingParams

_LOG2_E = 1.0 / math.log(2.0)
_BLOCK_SIZE = 256
"""Tokens per block of the two-round race (V = 49152: 192 blocks, 448 draws a row)."""
_TOP_P_CANDIDATES = (256, 4096, 16384)
"""Candidate-set sizes a top-p row tries in turn on the CPU before sorting its whole row.
SmolLM2-135M's nucleus at temperature 1 and top_p 0.9 has a median of 12 tokens and more than
256 at 9% of steps, more than 1024 at 1%; at temperature 1.5, more than 1024 at half of them.
On 64 rows of 49152, 2 threads: topk(256) costs 2.4 argmaxes, topk(4096) 7.5, topk(16384) 17,
a sort 42."""
_CPU_CHUNK_ELEMENTS = 1 << 20
"""Logits per chunk on the CPU (4 MiB of float32): a chunk's several passes hit the cache, and
its buffers, below glibc's 32 MiB mmap threshold, are reused rather than faulted in anew."""


@dataclass(kw_only=True, slots=True)
class SamplerOutput:
    token_ids: torch.Tensor
    """[N] int64 on the CPU: the token chosen for each row."""
    logprobs: LogprobRows | None
    """None when no row asked for logprobs. Otherwise every row's (``compute_logprobs``): its
    top tokens, as many as the row that asks for most (``params.logprobs``), then the sampled
    token. Logprobs are the log-softmax of the RAW logits, before penalties, logit_bias,
    allowed_token_ids, bad_words, temperature, top-k/p, min-p and the min_tokens mask (vLLM
    v1's default, "raw_logprobs")."""


class Sampler:
    """Stateless; one instance serves every step."""

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        *,
        num_output_tokens: Sequence[int] | None = None,
        eos_token_ids: Sequence[int] = (),
        history: HistoryRows | None = None,
        token_bitmask: TokenBitmask | None = None,
        on_sampled: Callable[[torch.Tensor], None] | None = None,
        to_host: bool = True,
    ) -> SamplerOutput:
        """Sample one token per row.

        logits: [N, V] float (cast to float32), on any device; left unchanged.
        params, generators: one per row; a generator must be on the logits' device.
        num_output_tokens: tokens each row has generated before this step. When given, a row
            with fewer than ``min_tokens`` cannot sample its stop_token_ids nor, unless
            ``ignore_eos``, ``eos_token_ids`` (their logits are set to -inf).
        history: the rows' tokens (``TokenHistory.rows_of``), which rows whose params
            ``needs_token_history`` must have.
        token_bitmask: the constrained rows' bits on the logits' device: such a row samples
            only the tokens whose bit is set (structured outputs, ``GrammarState.bitmask``).
        on_sampled: called with the [N] int64 token ids on the logits' device before they are
            copied to the host (token feedback sends them on from there).
        to_host: False leaves ``token_ids`` on the logits' device (no synchronization) when no
            row asks for logprobs; the caller brings them over.
        """
        assert logits.dim() == 2, f"logits must be [N, V], got {tuple(logits.shape)}"
        num_rows = logits.shape[0]
        assert len(params) == num_rows and len(generators) == num_rows, (
            f"{num_rows} rows but {len(params)} params and {len(generators)} generators"
        )
        assert num_output_tokens is None or len(num_output_tokens) == num_rows
        logits = logits.float()
        token_ids = _sample(logits, params, generators, num_output_tokens, eos_token_ids, history,
                            token_bitmask)  # [N]
        if on_sampled is not None:
            on_sampled(token_ids)
        wants_logprobs = any(p.logprobs is not None for p in params)
        if not to_host and not wants_logprobs:
            return SamplerOutput(token_ids=token_ids, logprobs=None)
        logprobs = None
        if wants_logprobs:
            num_top = max(p.logprobs or 0 for p in params)
            logprobs = logprob_rows(*compute_logprobs(logits, token_ids, num_top))
        return SamplerOutput(token_ids=token_ids.cpu(), logprobs=logprobs)

    def chosen(self, token_ids: torch.Tensor, *, on_sampled: Callable[[torch.Tensor], None] | None = None,
               to_host: bool = True) -> SamplerOutput:
        """The output of rows whose [N] ``token_ids`` were taken without this sampler (rows that
        ``takes_argmax``: what ``__call__`` would give them); ``on_sampled`` and ``to_host`` as
        for ``__call__``."""
        if on_sampled is not None:
            on_sampled(token_ids)
        return SamplerOutput(token_ids=token_ids.cpu() if to_host else token_ids, logprobs=None)


def takes_argmax(params: Sequence[SamplingParams], num_output_tokens: Sequence[int]) -> bool:
    """Whether the sampler would give every row the argmax of its raw logits and nothing else:
    some rows, each greedy and ``_raw``. Such a step needs no full-vocabulary logits
    (``LlamaForCausalLM.greedy_token_ids``; ``chosen``)."""
    assert len(params) == len(num_output_tokens)
    return bool(params) and all(p.is_greedy and _raw(p, done) for p, done in zip(params, num_output_tokens))


RACE_MIN_TEMPERATURE = 0.01
"""The race scores logit / T + noise in float32: below this temperature logit / T outgrows the
noise's resolution (float32's spacing at 25 / 1e-5 is 0.25) and rounding would favour the lower
of nearly tied tokens; such rows stay with this sampler, which subtracts the row's maximum first."""


def takes_race(params: Sequence[SamplingParams], num_output_tokens: Sequence[int]) -> bool:
    """Whether every row may take its token from the race over the vocab shards
    (``kernels/race.py``, ``LlamaForCausalLM.race_token_ids``): some rows, each ``_raw`` and
    greedy, or asking for a temperature only (no top-k, top-p or min-p), of at least
    ``RACE_MIN_TEMPERATURE`` and no seed. A seeded row stays with this sampler, whose draws it
    keeps whatever else shares its batch. (A NaN logit, a broken model's, never wins the race,
    where ``torch.argmax`` would take it.)"""
    assert len(params) == len(num_output_tokens)
    return bool(params) and all(
        _raw(p, done) and (p.is_greedy or (p.seed is None and p.temperature >= RACE_MIN_TEMPERATURE and p.top_k == 0
                                           and p.top_p == 1.0 and p.min_p == 0.0))
        for p, done in zip(params, num_output_tokens))


def race_inputs(params: Sequence[SamplingParams], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' [N] float32 1 / temperature (0: greedy) and [N] int64 noise seeds for the race,
    on ``device``. The seeds come from torch's default CPU generator: every rank of a TP group,
    seeded alike and drawing at the same steps, draws the same ones."""
    inv_temperature = [0.0 if p.is_greedy else 1.0 / p.temperature for p in params]
    seeds = torch.randint(1 << 62, (len(params),), dtype=torch.int64)
    return host_to_device(inv_temperature, torch.float32, device), host_to_device(seeds, torch.int64, device)


def _raw(p: SamplingParams, num_done: int) -> bool:
    """Whether nothing but the row's raw logits decides its token: no logprobs, structured
    output or anything that processes its logits (penalties, logit_bias, allowed_token_ids,
    bad_words), and past its min_tokens."""
    return (p.logprobs is None and p.structured_outputs is None and not p.processes_logits
            and num_done >= p.min_tokens)


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A generator for one seeded request, on the device that holds the logits."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)  # manual_seed takes 64 bits
    return generator


def _sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    num_output_tokens: Sequence[int] | None,
    eos_token_ids: Sequence[int],
    history: HistoryRows | None,
    token_bitmask: TokenBitmask | None,
) -> torch.Tensor:
    """[N] int64 token ids on the logits' device, one chunk of rows at a time."""
    # logits: [N, V]
    pieces = []
    for rows in _row_chunks(logits):
        x = logits[rows]  # [n, V], a view
        if token_bitmask is not None:
            x = apply_token_bitmask(x, token_bitmask, rows)
        x = process_logits(x, params[rows], None if history is None else history[rows])
        if num_output_tokens is not None:
            x = _apply_min_tokens(x, params[rows], num_output_tokens[rows], eos_token_ids)
        pieces.append(_sample_rows(x, params[rows], generators[rows]))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _row_chunks(logits: torch.Tensor) -> list[slice]:
    """On the CPU, runs of rows holding ``_CPU_CHUNK_ELEMENTS`` logits; elsewhere all rows."""
    num_rows, vocab_size = logits.shape
    if logits.device.type != "cpu":
        return [slice(0, num_rows)]
    step = max(1, _CPU_CHUNK_ELEMENTS // vocab_size)
    return [slice(start, start + step) for start in range(0, num_rows, step)]


def _sample_rows(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    # logits: [n, V]
    greedy = [i for i, p in enumerate(params) if p.is_greedy]
    if len(greedy) == len(params):
        return logits.argmax(dim=-1)
    if not greedy:
        return _race(_filtered_blocks(logits, params), generators)
    rest = [i for i, p in enumerate(params) if not p.is_greedy]
    index = host_to_device(greedy + rest, torch.int64, logits.device)
    greedy_index, rest_index = index.split([len(greedy), len(rest)])
    blocks = _filtered_blocks(logits.index_select(0, rest_index), [params[i] for i in rest])
    sampled = _race(blocks, [generators[i] for i in rest])
    token_ids = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    token_ids.index_copy_(0, greedy_index, logits.index_select(0, greedy_index).argmax(dim=-1))
    return token_ids.index_copy_(0, rest_index, sampled)


def _filtered_probs(
    logits: torch.Tensor, params: Sequence[SamplingParams | None]
) -> torch.Tensor:
    """Unnormalized probabilities after temperature, top-k, top-p, min-p (in that order).

    A None entry (a greedy row) gets no processing. Top-k keeps ties with the k-th logit. Top-p
    is taken over the top-k-renormalized distribution and keeps each token whose preceding
    mass (in descending order) is < top_p, which always keeps the top token; a token tied with
    the last one kept is kept too (as top-k keeps ties), whatever order a sort would give them.
    Min-p keeps tokens with prob >= min_p * max prob. (vLLM v1 applies min-p before
    top-k/top-p.) Returns [n, V] float32: exp((logit - max logit) / temperature) where kept
    (the top token 1; 0 below 2^-126), else 0.
    """
    return _filtered_blocks(logits, params).flatten(1)[:, : logits.shape[1]]


def _filtered_blocks(
    logits: torch.Tensor, params: Sequence[SamplingParams | None]
) -> torch.Tensor:
    """``_filtered_probs`` as [n, ceil(V / _BLOCK_SIZE), _BLOCK_SIZE], zero past V."""
    # logits: [n, V]
    num_rows, vocab_size = logits.shape
    settings = _RowSettings.of(params, vocab_size, logits.device)
    blocks = logits.new_empty(num_rows, -(-vocab_size // _BLOCK_SIZE), _BLOCK_SIZE)
    padded = blocks.view(num_rows, -1)  # [n, B * S]
    if padded.shape[1] > vocab_size:
        padded[:, vocab_size:].zero_()
    probs = padded[:, :vocab_size]  # [n, V]
    x_max = logits.amax(dim=-1, keepdim=True)  # [n, 1]
    _relative_probs(logits, x_max, settings.log2e_over_temperature, out=probs)
    threshold = _threshold(logits, probs, x_max, settings)  # [n, 1]
    if threshold is not None:
        probs.mul_(_at_or_above(logits, threshold))
    return blocks


def _relative_probs(
    logits: torch.Tensor, x_max: torch.Tensor, log2e_over_temperature: torch.Tensor, *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """exp((logit - max logit) / temperature), computed as a power of 2, with the powers
    below 2^-126 (float32's smallest normal) made 0. On the CPU exp2 costs less than exp, and
    MKL's exp (AMD processors) runs ~20x slower where its results underflow."""
    # logits: [n, C]; x_max, log2e_over_temperature: [n, 1]
    exponent = torch.sub(logits, x_max, out=out).mul_(log2e_over_temperature)
    return F.threshold_(exponent, -126.0, float("-inf")).exp2_()


def _at_or_above(logits: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """[n, V] float32: 1 where logit >= the row's threshold, else 0. The sign of a difference
    of floats is exact; a bool mask with where costs 1.3-2.4x this on the CPUs measured, with
    masked_fill_ 4x."""
    # logits: [n, V]; threshold: [n, 1]
    floor = threshold.clamp(min=torch.finfo(threshold.dtype).min)  # -inf - -inf would be NaN
    return torch.sub(logits, floor).sign_().add_(1.0).clamp_(max=1.0)


@dataclass(kw_only=True, slots=True)
class _RowSettings:
    """A chunk's per-row settings as [n, 1] columns on the device, a disabled filter a no-op,
    and what the host knows of them."""

    log2e_over_temperature: torch.Tensor
    """log2(e) / temperature (temperature 1 for a greedy row)."""
    kth_index: torch.Tensor
    """Where a top-k row's k-th largest logit lies among the first candidates (a float)."""
    top_k_floor: torch.Tensor
    """0 for a top-k row, -inf for the others: added to the k-th logit, the top-k cut."""
    top_p: torch.Tensor
    """inf where top-p is off."""
    min_p_offset: torch.Tensor
    """temperature * log(min_p) (-inf where min-p is off): the min-p cut below the max logit."""
    candidate_sizes: list[int]
    """Empty where no row uses top-k or top-p; see ``_candidate_sizes``."""
    uses_top_k: bool
    uses_top_p: bool
    uses_min_p: bool

    @classmethod
    def of(cls, params: Sequence[SamplingParams | None], vocab_size: int, device) -> _RowSettings:
        active = [p for p in params if p is not None]
        top_ks = [p.top_k for p in active if 0 < p.top_k < vocab_size]
        uses_top_p = any(p.top_p < 1.0 for p in active)
        sizes = _candidate_sizes(vocab_size, max(top_ks, default=0), uses_top_p, device)
        rows = [_row_settings(p, vocab_size, sizes[0] if sizes else 1) for p in params]
        columns = host_to_device(rows, torch.float32, device).split(1, dim=1)  # 5 x [n, 1]
        log2e_over_temperature, kth_index, top_k_floor, top_p, min_p_offset = columns
        return cls(
            log2e_over_temperature=log2e_over_temperature,
            kth_index=kth_index, top_k_floor=top_k_floor, top_p=top_p,
            min_p_offset=min_p_offset, candidate_sizes=sizes, uses_top_k=bool(top_ks),
            uses_top_p=uses_top_p, uses_min_p=any(p.min_p > 0.0 for p in active),
        )


def _row_settings(p: SamplingParams | None, vocab_size: int, num_candidates: int) -> tuple:
    if p is None:
        return (_LOG2_E, 0.0, float("-inf"), float("inf"), float("-inf"))
    has_top_k = 0 < p.top_k < vocab_size
    return (
        _LOG2_E / p.temperature,
        min(p.top_k, num_candidates) - 1 if has_top_k else 0.0,
        0.0 if has_top_k else float("-inf"),
        p.top_p if p.top_p < 1.0 else float("inf"),
        p.temperature * math.log(p.min_p) if p.min_p > 0.0 else float("-inf"),
    )


def _threshold(
    logits: torch.Tensor, probs: torch.Tensor, x_max: torch.Tensor, settings: _RowSettings
) -> torch.Tensor | None:
    """[n, 1]: the lowest logit each row keeps (-inf: every token); None if no row filters."""
    # logits, probs: [n, V] (probs unfiltered); x_max: [n, 1]
    cuts = []
    top_k_cut = None
    if settings.candidate_sizes:
        candidates = _largest(logits, settings.candidate_sizes[0])  # [n, C], descending
    if settings.uses_top_k:
        top_k_cut = candidates.gather(1, settings.kth_index.long()).add_(settings.top_k_floor)
        cuts.append(top_k_cut)
    if settings.uses_top_p:
        cuts.append(_top_p_threshold(logits, probs, candidates, top_k_cut, x_max, settings))
    if settings.uses_min_p:
        # probs[i] >= min_p * probs[top] <=> logit[i] >= max logit + temperature * log(min_p)
        cuts.append(x_max + settings.min_p_offset)
    if not cuts:
        return None
    threshold = cuts[0]
    for cut in cuts[1:]:
        threshold = torch.maximum(threshold, cut)
    return threshold


def _largest(logits: torch.Tensor, size: int) -> torch.Tensor:
    """[n, size]: each row's ``size`` largest logits, in descending order."""
    if size == logits.shape[1]:
        return logits.sort(dim=-1, descending=True).values  # cheaper than topk of everything
    return logits.topk(size, dim=-1).values


def _candidate_sizes(vocab_size: int, max_top_k: int, uses_top_p: bool, device) -> list[int]:
    """Sizes of the candidate sets (each row's largest logits) to try in turn, the last of
    which resolves every row; none where no row uses top-k or top-p. Top-k alone needs only its
    k. Top-p needs its whole nucleus: on the CPU the rows still unresolved try each of
    ``_TOP_P_CANDIDATES``, then sort; elsewhere finding those rows would wait for the device,
    so top-p sorts at once."""
    if not uses_top_p:
        return [max_top_k] if max_top_k else []
    if device.type != "cpu":
        return [vocab_size]
    # One past k: then a top-k row's candidates hold its whole top-k set unless k-th ties.
    sizes = {min(max(size, max_top_k + 1), vocab_size) for size in _TOP_P_CANDIDATES}
    return sorted(sizes | {vocab_size})


def _top_p_threshold(
    logits: torch.Tensor,
    probs: torch.Tensor,
    candidates: torch.Tensor,
    top_k_cut: torch.Tensor | None,
    x_max: torch.Tensor,
    settings: _RowSettings,
) -> torch.Tensor:
    """[n, 1]: the lowest logit top-p keeps in each row (-inf in rows without top-p)."""
    # logits, probs: [n, V]; candidates: [n, C]; top_k_cut (None: no top-k), x_max: [n, 1]
    vocab_size = logits.shape[1]
    sizes = settings.candidate_sizes
    total = None
    if sizes[0] < vocab_size:
        total = probs.sum(dim=-1, keepdim=True)  # [n, 1]
        if top_k_cut is not None:  # a top-k row renormalizes over its top-k set, never this
            total.masked_fill_(top_k_cut > float("-inf"), float("inf"))
    per_row = [x_max, settings.log2e_over_temperature, top_k_cut, settings.top_p, total]
    cut, resolved = _top_p_cut(candidates, *per_row, whole_row=sizes[0] == vocab_size)
    for size in sizes[1:]:  # the CPU only: reading `resolved` waits for nothing there
        pending = resolved.logical_not().squeeze(1).nonzero().squeeze(1)  # [m]
        if pending.numel() == 0:
            break
        wider = _largest(logits.index_select(0, pending), size)  # [m, size]
        of_pending = [None if t is None else t.index_select(0, pending) for t in per_row]
        pending_cut, now_resolved = _top_p_cut(wider, *of_pending, whole_row=size == vocab_size)
        cut.index_copy_(0, pending, pending_cut)
        if now_resolved is not None:
            resolved.index_copy_(0, pending, now_resolved)
    return cut


def _top_p_cut(
    candidates: torch.Tensor,
    x_max: torch.Tensor,
    log2e_over_temperature: torch.Tensor,
    top_k_cut: torch.Tensor | None,
    top_p: torch.Tensor,
    total: torch.Tensor | None,
    *,
    whole_row: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(cut, resolved), each [m, 1]: the lowest logit top-p keeps, exact where ``resolved``,
    i.e. where the candidates hold every token top-p may keep (None: all, the ``whole_row``).

    A row's probs are ``_relative_probs`` of its logits; ``total`` is their sum over the
    whole row (what rows without top-k renormalize by; inf in top-k rows, which stay
    unresolved until the candidates hold their top-k set), needed unless ``whole_row``.
    """
    # candidates: [m, C], each row's C largest logits in descending order; the rest: [m, 1]
    num_candidates = candidates.shape[1]
    probs = _relative_probs(candidates, x_max, log2e_over_temperature)  # [m, C]
    mass = probs.cumsum_(dim=-1)  # [m, C]: mass[j], that of candidates 0..j
    holds_top_k = None
    if top_k_cut is None:
        top_k_mass = mass[:, -1:] if whole_row else total
    else:
        # The top-k set is a prefix of the candidates: those >= the cut (all without top-k).
        num_top_k = torch.searchsorted(candidates.neg(), top_k_cut.neg(), right=True)  # [m, 1]
        holds_top_k = (num_top_k < num_candidates) | whole_row
        top_k_mass = mass.gather(1, num_top_k - 1)
        if not whole_row:
            top_k_mass = torch.where(holds_top_k, top_k_mass, total)
    # Candidate j is kept iff the mass before it, mass[j - 1], is < top_p (of the top-k mass).
    bound = top_p * top_k_mass
    num_kept = torch.searchsorted(mass, bound).clamp_(max=num_candidates - 1)  # [m, 1], - 1
    disabled = top_p.isinf()
    cut = candidates.gather(1, num_kept).masked_fill_(disabled, float("-inf"))
    if whole_row:
        return cut, None
    # Past the candidates, a token's preceding mass is at least theirs; top-k rows holding
    # their whole top-k set have nothing past them (the top-k cut drops the rest).
    resolved = (mass[:, -1:] >= bound) | disabled
    return cut, resolved if holds_top_k is None else resolved | holds_top_k


def _race(blocks: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """[n] int64: the token argmax(probs / q), q ~ Exp(1), in two rounds (see the module
    docstring); blocks: [n, B, S], the probs in blocks of S consecutive tokens."""
    num_rows, num_blocks, block_size = blocks.shape
    q = _exponentials(num_rows, num_blocks + block_size, generators, blocks.device)
    block = (blocks.sum(dim=-1) / q[:, :num_blocks]).argmax(dim=-1)  # [n]
    index = block.view(num_rows, 1, 1).expand(num_rows, 1, block_size)
    within = blocks.gather(1, index).squeeze(1)  # [n, S]
    token = (within / q[:, num_blocks:]).argmax(dim=-1)  # [n]
    return token.add_(block, alpha=block_size)


def _exponentials(
    num_rows: int, width: int, generators: Sequence[torch.Generator | None], device
) -> torch.Tensor:
    """[num_rows, width] Exp(1) draws; a row with a generator draws from it alone."""
    q = torch.empty(num_rows, width, device=device)
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if len(seeded) < num_rows:
        q.exponential_()  # the global generator, for the unseeded rows
    for i in seeded:
        q[i].exponential_(generator=generators[i])
    # exponential_ should not return 0, but a 0 would turn a filtered-out 0/0 into a NaN
    # that argmax picks.
    return q.clamp_(min=torch.finfo(q.dtype).tiny)


def _apply_min_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    num_output_tokens: Sequence[int],
    eos_token_ids: Sequence[int],
) -> torch.Tensor:
    """Copy of logits with stop/EOS tokens at -inf for rows still short of min_tokens."""
    assert len(num_output_tokens) == len(params)
    vocab_size = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    for i, (p, num_done) in enumerate(zip(params, num_output_tokens)):
        if num_done >= p.min_tokens:
            continue
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
        banned = [t for t in banned if t < vocab_size]
        rows += [i] * len(banned)
        cols += banned
    if not rows:
        return logits
    index = host_to_device([rows, cols], torch.int64, logits.device)  # [2, M]
    neg_inf = torch.tensor(float("-inf"), device=logits.device)
    return logits.index_put((index[0], index[1]), neg_inf)


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's ``num_top`` most likely tokens (descending), then its own token ``token_ids``:
    (ids [n, num_top + 1] int64, logprobs [n, num_top + 1] float32, ranks [n, num_top + 1]
    int64), on the logits' device, without waiting for it.

    Logprobs are the log-softmax of ``logits`` as given (the sampler's raw logits). A rank is
    1 + the number of tokens with a strictly larger logit, which order the tokens as their
    logprobs do: for the own token a count over the whole vocabulary, for a top token the
    count among the top tokens (every token larger than one of them is one of them); tied
    tokens share a rank.
    """
    # logits: [n, V] float32; token_ids: [n] int64
    top_values, top_ids = logits.topk(num_top, dim=-1)  # [n, k] each
    own = logits.gather(1, token_ids.unsqueeze(1))  # [n, 1]
    log_norm, num_larger = _log_norm_and_num_larger(logits, own)  # [n, 1] each
    top_ranks = (top_values.unsqueeze(1) > top_values.unsqueeze(2)).sum(dim=-1).add_(1)  # [n, k]
    ids = torch.cat([top_ids, token_ids.unsqueeze(1)], dim=1)
    values = torch.cat([top_values, own], dim=1).sub_(log_norm)
    ranks = torch.cat([top_ranks, num_larger.add_(1)], dim=1)
    return ids, values, ranks


def logprob_rows(ids: torch.Tensor, logprobs: torch.Tensor, ranks: torch.Tensor) -> LogprobRows:
    """``compute_logprobs``' tensors on the host, as the wire carries them (waits for them)."""
    # ids, logprobs, ranks: [n, k + 1]
    return LogprobRows(num_top=ids.shape[1] - 1, token_ids=ids.flatten().tolist(),
                       logprobs=logprobs.flatten().tolist(), ranks=ranks.flatten().tolist())


def _log_norm_and_num_larger(logits: torch.Tensor, own: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([n, 1] logsumexp, [n, 1] int64 count of logits > ``own``), in chunks of rows on the
    CPU (as ``_sample``): the [n, V] temporaries stay small."""
    # logits: [n, V]; own: [n, 1]
    chunks = _row_chunks(logits)
    norms = [logits[rows].logsumexp(dim=-1, keepdim=True) for rows in chunks]
    counts = [(logits[rows] > own[rows]).sum(dim=-1, keepdim=True) for rows in chunks]
    if len(chunks) == 1:
        return norms[0], counts[0]
    return torch.cat(norms), torch.cat(counts)
