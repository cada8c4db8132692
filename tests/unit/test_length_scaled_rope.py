"""Dynamic NTK and LongRoPE past the original context, against transformers.

Their frequencies follow the sequence's length when a token is computed: transformers sets them
per forward from the forward's largest position + 1, and keys already in its cache keep theirs.
So the reference is transformers fed the same chunks of each sequence through its KV cache
(``hf_logits_by_chunks``): a whole prompt is one forward, a decode step a one-token forward. The
tiny models' original context (32 tokens) is shorter than the prompts; CPU float32 must match
within 1e-4, and a packed step gives each sequence its own frequencies.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers_model

from helpers_model import (  # noqa: E402
    LENGTH_SCALED_KINDS,
    TINY_ORIGINAL_CONTEXT,
    PagedRunner,
    hf_logits_by_chunks,
    tiny_hf_config,
    write_tiny_checkpoint,
)

from pipeserve.runtime.model.llama import LengthScaledRotaryEmbedding, dynamic_ntk_inv_freq  # noqa: E402
from pipeserve.runtime.model.model_config import ModelConfig  # noqa: E402
from pipeserve.runtime.model.weights import load_hf_model  # noqa: E402

ATOL = 1e-4


def _tokens(length: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float().cpu() - b.float().cpu()).abs().max().item()


@pytest.fixture(scope="module", params=LENGTH_SCALED_KINDS)
def tiny(request, tmp_path_factory):
    kind = request.param
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), kind, seed=30 + LENGTH_SCALED_KINDS.index(kind))
    model, config = load_hf_model(folder, dtype=torch.float32, device="cpu")
    assert isinstance(model.rotary_emb, LengthScaledRotaryEmbedding)
    assert config.rope_scaling["original_max_position_embeddings"] == TINY_ORIGINAL_CONTEXT
    return SimpleNamespace(kind=kind, folder=folder, model=model)


def test_frequencies_match_transformers():
    """Dynamic NTK's base for a length (transformers computes it from a tensor length, as in a
    forward), LongRoPE's long factors as transformers loads them past the original context."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = tiny_hf_config("llama_dynamic_rope")
    config = ModelConfig.from_hf_dict(hf_config.to_dict())
    lengths = [1, 32, 33, 50, 128]
    got = dynamic_ntk_inv_freq(config, torch.tensor(lengths, dtype=torch.int32))
    for row, length in zip(got, lengths, strict=True):
        want, scale = ROPE_INIT_FUNCTIONS["dynamic"](hf_config, "cpu", seq_len=torch.tensor(length))
        torch.testing.assert_close(row, want, rtol=1e-6, atol=0)
        assert scale == 1.0
    assert not torch.allclose(got[3], got[1])  # the base grows past the original context

    hf_config = tiny_hf_config("phi4_mini_long")
    rope = LengthScaledRotaryEmbedding(ModelConfig.from_hf_dict(hf_config.to_dict()))
    want, scale = ROPE_INIT_FUNCTIONS["longrope"](hf_config, "cpu", seq_len=TINY_ORIGINAL_CONTEXT + 1)
    assert torch.equal(rope.long_inv_freq, want) and rope.scale == scale


def test_whole_prompt_past_the_original_context(tiny):
    prompt = _tokens(48, seed=1)
    [logits] = PagedRunner(tiny.model).step([(0, prompt)])
    assert _max_diff(logits, hf_logits_by_chunks(tiny.folder, [prompt])) < ATOL


def test_greedy_decode_across_the_original_context(tiny):
    """A prompt within the original context, then decode steps that carry it past (the keys of
    earlier steps keep their rotation)."""
    prompt = _tokens(24, seed=2)
    runner = PagedRunner(tiny.model, seed=2)
    logits, tokens = runner.step([(0, prompt)]), list(prompt)
    for _ in range(16):  # to 40 tokens
        tokens.append(int(logits[-1][-1].argmax()))
        logits += runner.step([(0, tokens[-1:])])
    ref = hf_logits_by_chunks(tiny.folder, [prompt] + [[t] for t in tokens[len(prompt) :]])
    assert _max_diff(torch.cat(logits), ref) < ATOL


def test_chunked_prefill_matches_transformers_fed_the_same_chunks(tiny):
    """Chunks ending at 16, 32 (within), 48 and 56 (past), then decode steps."""
    prompt = _tokens(56, seed=3)
    chunks = [prompt[i : i + 16] for i in range(0, len(prompt), 16)] + [[5], [9], [200]]
    runner = PagedRunner(tiny.model, seed=3)
    ours = torch.cat([runner.step([(0, chunk)])[0] for chunk in chunks])
    ref = hf_logits_by_chunks(tiny.folder, chunks)
    assert _max_diff(ours, ref) < ATOL
    # The chunking matters: one forward over the prompt turns every key by its 56 tokens.
    assert _max_diff(ref[:56], hf_logits_by_chunks(tiny.folder, [prompt])) > 100 * ATOL


def _check_packed_steps(model, folder, steps, *, atol: float, device: str = "cpu", seed: int = 0) -> None:
    """Run ``steps`` (lists of (seq_id, tokens)) packed through ``model``; each sequence's logits
    must match transformers fed that sequence's chunks alone."""
    runner = PagedRunner(model, seed=seed, device=device)
    got = {0: [], 1: []}
    for step in steps:
        for (seq_id, _), logits in zip(step, runner.step(step), strict=True):
            got[seq_id].append(logits)
    for seq_id in (0, 1):
        chunks = [tokens for step in steps for s, tokens in step if s == seq_id]
        assert _max_diff(torch.cat(got[seq_id]), hf_logits_by_chunks(folder, chunks, device=device)) < atol


def test_packed_steps_give_each_sequence_its_own_frequencies(tiny):
    """Sequence 0 is past the original context from its first step; sequence 1 stays within it,
    then crosses it in a step that packs it beside sequence 0's decode."""
    a, b = _tokens(42, seed=4), _tokens(36, seed=5)
    steps = [
        [(0, a[:40]), (1, b[:20])],
        [(1, b[20:28]), (0, a[40:41])],
        [(0, a[41:42]), (1, b[28:36])],  # sequence 1: 28 -> 36 tokens
    ]
    _check_packed_steps(tiny.model, tiny.folder, steps, atol=ATOL, seed=4)


# --- GPU ----------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kind", LENGTH_SCALED_KINDS)
def test_gpu_float32_chunks_and_packed_decodes_match_transformers(tmp_path, kind, backend):
    """On the GPU, through either op table: chunked prefills of two sequences (one past the
    original context), then packed decode steps carrying the other past it."""
    from pipeserve.kernels import kernel_ops

    folder = write_tiny_checkpoint(tmp_path, kind)
    model, _ = load_hf_model(folder, dtype=torch.float32, device="cuda")
    model.set_ops(kernel_ops(backend, torch.device("cuda")))
    a, b = _tokens(60, seed=6), _tokens(40, seed=7)
    steps = [[(0, a[:24])], [(0, a[24:48]), (1, b[:28])]]
    steps += [[(0, a[i : i + 1]), (1, b[j : j + 1])] for i, j in zip(range(48, 60), range(28, 40), strict=True)]
    _check_packed_steps(model, folder, steps, atol=1e-3, device="cuda")
