"""A worker's host prepares micro-batch j + 1 while the device still runs j: the host-to-device
copies of a step's inputs (``runtime/worker/batch.py``: ``to_tensors``, ``host_to_device``; the CUDA
graph runner and the token-feedback patch use the same helpers) must not wait for the stream's
earlier work, nor must a step's structured-output masks and the noting of its sampled ids
(``runtime/worker/grammar.py``). On CUDA: with the stream busy for a long while, preparing a
step returns at once and its tensors hold the right values; on CPU: the helper's dtypes and
values."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from pipeserve.parallel.wire import SeqPlan
from pipeserve.runtime.worker.batch import StepInputs, host_to_device, to_tensors
from pipeserve.runtime.worker.grammar import GrammarCompiler, GrammarState
from pipeserve.runtime.worker.sampler import Sampler
from pipeserve.scheduler.sampling_params import SamplingParams, StructuredOutputsParams


def _step() -> StepInputs:
    # a 5-token chunk at position 3 (blocks 7, 2) and a decode at position 40 (blocks 1, 4, 9)
    return StepInputs(request_ids=["a", "b"], token_ids=[11, 12, 13, 14, 15, 99], query_lens=[5, 1],
                      start_positions=[3, 40], block_tables=[[7, 2], [1, 4, 9]], needs_sample=[True, True])


def test_host_to_device_converts_and_copies_on_cpu():
    a = np.arange(6, dtype=np.int64)[::2]  # not contiguous
    t = host_to_device(a, torch.int32, torch.device("cpu"))
    assert t.dtype == torch.int32 and t.tolist() == [0, 2, 4]
    assert host_to_device(np.array([True, False]), torch.bool, torch.device("cpu")).tolist() == [True, False]


def _busy_stream_seconds(cycles: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_preparing_a_step_does_not_wait_for_the_stream():
    device = torch.device("cuda")
    reference = to_tensors(_step(), block_size=16, device=torch.device("cpu"))
    to_tensors(_step(), block_size=16, device=device)  # (first use: the pinned pool, the context)
    torch.cuda.synchronize()
    cycles = 200_000_000
    busy = _busy_stream_seconds(cycles)
    assert busy > 0.02, busy  # the device's sleep is long enough to tell
    torch.cuda._sleep(cycles)  # the stream is busy for `busy` seconds
    t0 = time.perf_counter()
    inputs = to_tensors(_step(), block_size=16, device=device)
    fed = host_to_device(np.array([3, 1], dtype=np.int64), torch.int64, device)
    host = time.perf_counter() - t0
    assert host < busy / 4, (host, busy)
    torch.cuda.synchronize()
    for name in ("input_ids", "positions", "sample_indices"):
        assert torch.equal(getattr(inputs, name).cpu(), getattr(reference, name)), name
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        got, want = getattr(inputs.meta, name), getattr(reference.meta, name)
        assert got.dtype == want.dtype and torch.equal(got.cpu(), want), name
    assert fed.tolist() == [3, 1]


def _digits_tokenizer(folder):
    """A byte-level BPE of a few hundred tokens (EOS "<|endoftext|>"), as a pipeserve Tokenizer."""
    import json

    from tokenizers import Tokenizer as BackendTokenizer, decoders, models, pre_tokenizers, trainers

    from pipeserve.runtime.model.tokenizer import Tokenizer

    bpe = BackendTokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([f"{i} {i * 7} {i * 31}" for i in range(500)], trainer)
    bpe.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return Tokenizer.from_hf_folder(str(folder))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_constrained_step_does_not_wait_for_the_stream(tmp_path):
    """With the stream busy, a step's masks (the previous ids taken already), its sampling and
    the noting of its ids return at once; the constrained rows then sample digits only."""
    device = torch.device("cuda")
    tokenizer = _digits_tokenizer(tmp_path)
    eos = tokenizer.eos_token_id
    vocab_size = tokenizer.vocab_size
    state = GrammarState(GrammarCompiler(tokenizer, vocab_size=vocab_size, eos_token_ids=[eos]), device)
    digits = SamplingParams(temperature=0, structured_outputs=StructuredOutputsParams(regex="[0-9]{1,20}"))
    free = SamplingParams(temperature=0)

    def step(n: int) -> list[SeqPlan]:
        return [SeqPlan(request_id=str(i), num_computed_tokens=8 + n, num_scheduled_tokens=1, new_token_ids=[0],
                        block_table=[0], needs_sample=True, sampling=digits if i % 2 else free, num_output_tokens=n)
                for i in range(4)]

    sampler = Sampler()
    logits = torch.randn(4, vocab_size, device=device)
    seqs = step(0)  # (first use: the pinned pool, xgrammar's kernel)
    first = sampler(logits, [s.sampling for s in seqs], [None] * 4, token_bitmask=state.bitmask(seqs))
    state.accept(seqs, first.token_ids)
    torch.cuda.synchronize()
    cycles = 200_000_000
    busy = _busy_stream_seconds(cycles)
    torch.cuda._sleep(cycles)
    seqs = step(1)
    t0 = time.perf_counter()
    out = sampler(logits, [s.sampling for s in seqs], [None] * 4, token_bitmask=state.bitmask(seqs),
                  on_sampled=lambda ids: state.accept_later(seqs, ids), to_host=False)
    host = time.perf_counter() - t0
    assert host < busy / 4, (host, busy)
    state.bitmask(step(2))  # waits for step 1's ids and advances the matchers by them
    for i, (a, b) in enumerate(zip(first.token_ids.tolist(), out.token_ids.tolist())):
        if i % 2:
            assert tokenizer.decode([a, b]).isdigit(), tokenizer.decode([a, b])
        else:
            assert b == int(logits[i].argmax())
