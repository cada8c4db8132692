"""Turn one step's logits into next tokens: greedy, or temperature + top-k + top-p + min-p.

The batch is processed as a whole, on the logits' device, with one host->device copy of the
per-row settings and one device->host copy of the chosen ids (plus one of the logprobs when a
row asks for them). Greedy rows take the argmax of the raw logits; the filtered distribution is
computed for every row but only used for the random ones.

Random rows sample by an exponential race, ``argmax(probs / q)`` with ``q ~ Exp(1)``, which
draws token i with probability probs[i] / sum(probs) (no renormalization needed). A row with a
generator fills its own ``q`` from that generator only, V draws per step, so a seeded request
produces the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pipeserve.runtime.worker.batch import host_to_device
from pipeserve.scheduler.sampling_params import SamplingParams


@dataclass(kw_only=True, slots=True)
class SamplerOutput:
    token_ids: torch.Tensor
    """[N] int64 on the CPU: the token chosen for each row."""
    logprobs: list[dict[int, float] | None] | None
    """None when no row asked for logprobs. Otherwise, per row, None if that row's
    ``params.logprobs`` is None, else ``{token_id: logprob}`` holding its top-k tokens in
    descending order, then the sampled token if it is not among them. Logprobs are the
    log-softmax of the RAW logits, before temperature, top-k/p, min-p and the min_tokens mask
    (vLLM v1's default, "raw_logprobs")."""


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
        on_sampled: Callable[[torch.Tensor], None] | None = None,
        to_host: bool = True,
    ) -> SamplerOutput:
        """Sample one token per row.

        logits: [N, V] float (cast to float32), on any device.
        params, generators: one per row; a generator must be on the logits' device.
        num_output_tokens: tokens each row has generated before this step. When given, a row
            with fewer than ``min_tokens`` cannot sample its stop_token_ids nor, unless
            ``ignore_eos``, ``eos_token_ids`` (their logits are set to -inf).
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
        logits = logits.float()
        raw_logprobs = None
        if any(p.logprobs is not None for p in params):
            raw_logprobs = torch.log_softmax(logits, dim=-1)  # [N, V]
        if num_output_tokens is not None:
            logits = _apply_min_tokens(logits, params, num_output_tokens, eos_token_ids)
        token_ids = _sample(logits, params, generators)  # [N] int64, on the logits' device
        if on_sampled is not None:
            on_sampled(token_ids)
        if not to_host and raw_logprobs is None:
            return SamplerOutput(token_ids=token_ids, logprobs=None)
        token_ids_cpu = token_ids.cpu()
        logprobs = None
        if raw_logprobs is not None:
            logprobs = _gather_logprobs(raw_logprobs, token_ids, token_ids_cpu.tolist(), params)
        return SamplerOutput(token_ids=token_ids_cpu, logprobs=logprobs)


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
) -> torch.Tensor:
    # logits: [N, V]
    greedy = [p.is_greedy for p in params]
    if all(greedy):
        return logits.argmax(dim=-1)
    random_rows = [i for i, g in enumerate(greedy) if not g]
    probs = _filtered_probs(logits, [None if g else p for p, g in zip(params, greedy)])
    sampled = _exponential_race(probs, generators, random_rows)
    if not any(greedy):
        return sampled
    is_greedy = host_to_device(greedy, torch.bool, logits.device)
    return torch.where(is_greedy, logits.argmax(dim=-1), sampled)


def _filtered_probs(
    logits: torch.Tensor, params: Sequence[SamplingParams | None]
) -> torch.Tensor:
    """Unnormalized probabilities after temperature, top-k, top-p, min-p (in that order).

    A None entry (a greedy row) gets no processing. Top-k keeps ties with the k-th logit. Top-p
    is taken over the top-k-renormalized distribution and keeps each token whose preceding
    mass (in descending order) is < top_p, which always keeps the top token. Min-p keeps
    tokens with prob >= min_p * max prob. (vLLM v1 applies min-p before top-k/top-p.)
    """
    num_rows, vocab_size = logits.shape
    active = [p for p in params if p is not None]
    use_top_k = any(p.top_k > 0 for p in active)
    use_top_p = any(p.top_p < 1.0 for p in active)
    use_min_p = any(p.min_p > 0.0 for p in active)
    # Disabled settings become no-ops: temperature 1, k = V, top_p = inf, min_p = 0.
    rows = [
        (1.0, vocab_size, float("inf"), 0.0)
        if p is None
        else (
            p.temperature,
            min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size,
            p.top_p if p.top_p < 1.0 else float("inf"),
            p.min_p,
        )
        for p in params
    ]
    settings = host_to_device(rows, torch.float32, logits.device)  # [N, 4]
    temperature, top_k, top_p, min_p = settings.unbind(dim=1)  # each [N]

    logits = logits / temperature.unsqueeze(1)
    if not (use_top_k or use_top_p):
        probs = logits.softmax(dim=-1)
        if use_min_p:
            max_prob = probs.amax(dim=-1, keepdim=True)
            probs.masked_fill_(probs < min_p.unsqueeze(1) * max_prob, 0.0)
        return probs

    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, V] each
    if use_top_k:
        kth = sorted_logits.gather(1, top_k.long().sub(1).unsqueeze(1))  # [N, 1]
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)  # [N, V], descending
    if use_top_p:
        mass_before = probs.cumsum(dim=-1) - probs
        probs.masked_fill_(mass_before >= top_p.unsqueeze(1), 0.0)
    if use_min_p:
        probs.masked_fill_(probs < min_p.unsqueeze(1) * probs[:, :1], 0.0)
    return torch.empty_like(probs).scatter_(1, order, probs)


def _exponential_race(
    probs: torch.Tensor, generators: Sequence[torch.Generator | None], rows: Sequence[int]
) -> torch.Tensor:
    """argmax(probs / q), q ~ Exp(1); only ``rows`` matter, the others return garbage."""
    # probs: [N, V]
    q = torch.empty_like(probs)
    seeded = [i for i in rows if generators[i] is not None]
    if len(seeded) < len(rows):
        q.exponential_()  # the global generator, for the unseeded rows
    for i in seeded:
        q[i].exponential_(generator=generators[i])
    # exponential_ should not return 0, but a 0 would turn a filtered-out 0/0 into a NaN
    # that argmax picks; clamping costs one pass.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return probs.div_(q).argmax(dim=-1)


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


def _gather_logprobs(
    raw_logprobs: torch.Tensor,
    token_ids: torch.Tensor,
    token_ids_cpu: list[int],
    params: Sequence[SamplingParams],
) -> list[dict[int, float] | None]:
    # raw_logprobs: [N, V], token_ids: [N] on its device
    max_k = max(p.logprobs or 0 for p in params)
    top_values, top_ids = raw_logprobs.topk(max_k, dim=-1)  # [N, max_k] each
    sampled = raw_logprobs.gather(1, token_ids.unsqueeze(1))  # [N, 1]
    values = torch.cat([top_values, sampled], dim=1).tolist()  # [N, max_k + 1]
    top_ids = top_ids.tolist()
    out: list[dict[int, float] | None] = []
    for i, p in enumerate(params):
        if p.logprobs is None:
            out.append(None)
            continue
        row = dict(zip(top_ids[i][: p.logprobs], values[i][: p.logprobs]))
        row.setdefault(token_ids_cpu[i], values[i][-1])
        out.append(row)
    return out
