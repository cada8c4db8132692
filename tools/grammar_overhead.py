"""Per-step cost of structured outputs on the host: for a batch of constrained rows over
SmolLM2's 49152-token vocabulary, fill the xgrammar bitmask (``GrammarState.bitmask``), apply it
to random logits (``apply_token_bitmask``) and advance each matcher by its (greedy) token.

    python tools/grammar_overhead.py [--rows 32] [--steps 50]
"""

from __future__ import annotations

import argparse
import time

import torch

from pipeserve.parallel.wire import SeqPlan
from pipeserve.runtime.model.gguf_loader import default_model_path, read_gguf
from pipeserve.runtime.model.tokenizer import Tokenizer
from pipeserve.runtime.worker.grammar import GrammarCompiler, GrammarState, apply_token_bitmask
from pipeserve.scheduler.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "tags"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    compiler = GrammarCompiler(Tokenizer.from_gguf(read_gguf(default_model_path())), vocab_size=49152,
                               eos_token_ids=[2])
    state = GrammarState(compiler)
    params = SamplingParams(temperature=0, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    fill = apply = accept = 0.0
    for n in range(args.steps):
        seqs = [SeqPlan(request_id=str(i), num_computed_tokens=n, num_scheduled_tokens=1, new_token_ids=[0],
                        block_table=[0], needs_sample=True, sampling=params, num_output_tokens=n)
                for i in range(args.rows)]
        t0 = time.perf_counter()
        mask = state.bitmask(seqs)
        t1 = time.perf_counter()
        ids = apply_token_bitmask(torch.randn(args.rows, 49152), mask).argmax(dim=-1)
        t2 = time.perf_counter()
        state.accept(seqs, ids)
        t3 = time.perf_counter()
        fill, apply, accept = fill + t1 - t0, apply + t2 - t1, accept + t3 - t2
    per = lambda x: x / args.steps * 1e3  # noqa: E731
    print(f"xgrammar, {args.rows} rows, V=49152, per step: fill {per(fill):.2f} ms, "
          f"apply (CPU torch) {per(apply):.2f} ms, accept {per(accept):.2f} ms")


if __name__ == "__main__":
    main()
