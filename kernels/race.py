"""A row's sampled token as the winner of a race over its vocabulary, for rows that ask for
nothing but a temperature (or for greedy rows, which race without noise).

Token i of a row with temperature T scores ``logit_i / T + g_i``, where ``g_i = -log(-log u_i)``
is Gumbel noise from a uniform ``u_i``; the first maximum's token is distributed as
softmax(logits / T) (the Gumbel-max trick, the exponential race ``argmax(p_i / E_i)`` of the
sampler in another form). ``u_i`` is Triton's counter-based Philox of (the row's seed, the
token's global id): a token's noise depends on nothing else, so a vocabulary split over TP ranks
races exactly as a whole one (each rank scores its own shard, ``parallel.context.tp_argmax``
finds the overall first maximum) and nothing but the logits is read: one pass, no probabilities
stored. A greedy row (``inv_temperature`` 0) scores its raw logits.

The grid is (rows, chunks of ``CHUNK`` tokens): each program keeps the first maximum of its
chunk, and the chunks' winners are compared with torch (the first chunk of the maximum wins).
A NaN score never wins. The noise is float32: ``-log(u)`` is at least 2**-24 or so, so ``g`` at
most about 16.6, and a token less likely than about 1e-8 times the row's most likely one is
(almost) never drawn, as with any float32 exponential race. Reference:
``kernels.reference.race_max_reference`` (NumPy: Triton's Philox uniforms bit for bit, the
scores within float32 rounding, as the GPU fuses the multiply and the add).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 8192  # tokens a program races: 16 programs a row of Llama 3's 128,256
BLOCK = 1024
NUM_WARPS = 4


@triton.jit
def _race_max_kernel(logits_ptr, stride, vocab_size, inv_temperature_ptr, seeds_ptr, vocab_start,
                     values_ptr, index_ptr, num_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    inv_t = tl.load(inv_temperature_ptr + row)
    seed = tl.load(seeds_ptr + row)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    where = tl.zeros([BLOCK], tl.int32)
    for start in range(chunk * CHUNK, tl.minimum(chunk * CHUNK + CHUNK, vocab_size), BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < vocab_size
        x = tl.load(logits_ptr + row.to(tl.int64) * stride + cols, mask=mask, other=float("-inf")).to(tl.float32)
        if inv_t > 0:
            u = tl.rand(seed, cols + vocab_start)  # [0, 1): u = 0 scores -inf
            x = x * inv_t - tl.log(-tl.log(u))
        take = x > best  # strictly: a lane keeps its first maximum (its columns only grow)
        best = tl.where(take, x, best)
        where = tl.where(take, cols, where)
    top = tl.max(best, axis=0)
    first = tl.min(tl.where(best == top, where, vocab_size), axis=0)
    tl.store(values_ptr + row * num_chunks + chunk, top)
    tl.store(index_ptr + row * num_chunks + chunk, tl.minimum(first, vocab_size - 1) + vocab_start)


def race_max(logits: torch.Tensor, inv_temperature: torch.Tensor, seeds: torch.Tensor,
             vocab_start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's winning score and its token: ([N] float32, [N] int64 global ids).

    logits: [N, V] (any float dtype; this rank's vocab shard, whose first column is token
    ``vocab_start``); inv_temperature: [N] float32, 1 / T (0: greedy); seeds: [N] int64, the
    rows' noise seeds. A row's winner is the first maximum of its scores; a row of -inf (or NaN)
    scores only gives its first token with score -inf.
    """
    # logits: [N, V]
    assert logits.dim() == 2 and logits.stride(1) == 1, (logits.shape, logits.stride())
    num_rows, vocab_size = logits.shape
    assert inv_temperature.shape == seeds.shape == (num_rows,), (inv_temperature.shape, seeds.shape)
    assert inv_temperature.dtype == torch.float32 and seeds.dtype == torch.int64
    assert 0 < vocab_size and vocab_start + vocab_size < 2**31, (vocab_start, vocab_size)
    num_chunks = triton.cdiv(vocab_size, CHUNK)
    values = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=logits.device)
    index = torch.empty(num_rows, num_chunks, dtype=torch.int32, device=logits.device)
    if num_rows:
        _race_max_kernel[(num_rows, num_chunks)](logits, logits.stride(0), vocab_size, inv_temperature, seeds,
                                                 vocab_start, values, index, num_chunks, CHUNK=CHUNK, BLOCK=BLOCK,
                                                 num_warps=NUM_WARPS)
    best = values.argmax(dim=-1, keepdim=True)  # [N, 1]: the first chunk of the maximum
    return values.gather(-1, best).squeeze(-1), index.gather(-1, best).squeeze(-1).long()
