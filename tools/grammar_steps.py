"""Structured outputs' host time per step.

    python -m tools.grammar_steps engine [--num-requests 32] [--json-fraction 0.25] [--max-tokens 64]
    python -m tools.grammar_steps batch [--rows 256] [--constrained 64] [--threads 1,2,4,8] [--tokenizer F.json]

``engine`` measures it in the real engine on the CPU: the embedded SmolLM2-135M-Instruct, one
batch of chat requests of which ``--json-fraction`` ask for a JSON object under a schema,
against the same batch unconstrained. The constrained run goes first; each constrained request
stops where its object ends, and the plain run then gives that request exactly as many tokens
(``ignore_eos``), so both runs schedule the same steps over the same rows. Prints, per run, the
engine steps and their mean wall time (``LLMEngine.step``), and, in the constrained run, the
time per step with constrained rows spent in each grammar call: the masks
(``Worker._token_bitmask``: the previous step's ids accepted, the rows filled, the copy to the
device), noting the sampled ids (``GrammarState.accept_later``) and applying the masks to the
logits (the sampler's ``apply_token_bitmask``). It wraps those by name, so it measures an
older checkout too (put that tree first on PYTHONPATH as ``pipeserve``). On the CPU the forward
does not overlap the host's work, so the step-time difference between the runs is the
grammar's whole cost; on a GPU the masks are filled beside the forward, and what matters is
the host time.

``batch`` measures the driver's part alone, without a model, on ``--device``: ``--rows`` greedy
rows of random logits over SmolLM2's vocabulary (or ``--tokenizer``'s), ``--constrained`` of
them under the JSON schema (random logits walk its strings through rare tokens), for
``--steps`` steps: the host time of the masks (``GrammarState.bitmask``), of sampling with them
(``Sampler``, its kernels launched) and of noting the ids, per step after the first two (the
schema's compilation), for each count of xgrammar's fill threads.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections import defaultdict

import torch

from pipeserve import LLM, SamplingParams, StructuredOutputsParams
from pipeserve.runtime.engine.llm_engine import LLMEngine
from pipeserve.runtime.worker import grammar, sampler, worker

SCHEMA = {"type": "object", "properties": {"title": {"type": "string"},
                                           "items": {"type": "array", "items": {"type": "string"}}},
          "required": ["title", "items"]}
"""benchmarks/throughput.py's --json-fraction schema."""
TOPICS = ["fruits", "rivers", "programming languages", "birds", "cities in Italy", "board games", "chemical elements",
          "famous painters", "vegetables", "musical instruments", "planets and moons", "dog breeds"]
WARMUP_STEPS = 2
"""``batch``: steps left out of the times (the schema's compilation, the first matchers)."""
TIMED = [(worker.Worker, "_token_bitmask", "mask"), (grammar.GrammarState, "accept_later", "note ids"),
         (sampler, "apply_token_bitmask", "apply")]


class Timers:
    """Wraps the engine's step and the grammar calls; sums their seconds per engine step."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def install(self) -> None:
        self._wrap(LLMEngine, "step", "step", new_step=True)
        for owner, name, label in TIMED:
            if hasattr(owner, name):
                self._wrap(owner, name, label)

    def _wrap(self, owner, name: str, label: str, new_step: bool = False) -> None:
        inner = getattr(owner, name)

        @functools.wraps(inner)
        def timed(*args, **kwargs):
            if new_step:
                self.steps.append(defaultdict(float))
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if self.steps:
                    self.steps[-1][label] += time.perf_counter() - t0

        setattr(owner, name, timed)


def chats(num_requests: int, json_every: int) -> list[list[dict]]:
    out = []
    for i in range(num_requests):
        topic = TOPICS[i % len(TOPICS)]
        ask = (f"Give a JSON object with a title and a list of twenty {topic}." if i % json_every == 0
               else f"Write a long story about {topic}.")
        out.append([{"role": "user", "content": ask}])
    return out


def run(llm: LLM, timers: Timers, messages, params) -> tuple[list, list[dict[str, float]]]:
    timers.steps = []
    outs = llm.chat(messages, params, use_tqdm=False)
    return outs, [s for s in timers.steps if s["step"] > 0]


def report(name: str, steps: list[dict[str, float]], num_tokens: int) -> None:
    wall = sum(s["step"] for s in steps)
    print(f"{name}: {len(steps)} steps, {wall:.2f} s, {num_tokens / wall:.0f} output tok/s, "
          f"step {wall / len(steps) * 1e3:.2f} ms mean")
    constrained = [s for s in steps if s.get("apply", 0) > 0]
    if constrained:
        parts = ", ".join(f"{label} {statistics.fmean(s.get(label, 0.0) for s in constrained) * 1e3:.3f} ms"
                          for _, _, label in TIMED)
        print(f"  grammar, per step with constrained rows ({len(constrained)}): {parts}")


def engine(args) -> None:
    json_every = round(1 / args.json_fraction)
    messages = chats(args.num_requests, json_every)
    free = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    json_params = SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    constrained = [json_params if i % json_every == 0 else free for i in range(args.num_requests)]
    llm = LLM(device="cpu", max_num_seqs=args.num_requests)
    timers = Timers()
    timers.install()
    llm.chat(messages[:4], constrained[:4], use_tqdm=False)  # warm-up: the vocabulary index, the first compile
    for _ in range(args.rounds):
        outs, steps = run(llm, timers, messages, constrained)
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        report("constrained", steps, sum(lengths))
        plain = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
        _, steps = run(llm, timers, messages, plain)
        report("plain      ", steps, sum(lengths))
    llm.close()


def batch(args) -> None:
    import xgrammar as xgr

    from pipeserve.parallel.wire import SeqPlan, StepPlan

    device = torch.device(args.device)
    tokenizer = _tokenizer(args.tokenizer)
    vocab_size = tokenizer.vocab_size
    compiler = grammar.GrammarCompiler(tokenizer, vocab_size=vocab_size, eos_token_ids=tokenizer.eos_token_ids)
    json_params = SamplingParams(temperature=0, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    every = args.rows // args.constrained
    params = [json_params if i % every == 0 and i // every < args.constrained else SamplingParams(temperature=0)
              for i in range(args.rows)]
    sample = sampler.Sampler()
    logits = torch.randn(args.steps, args.rows, vocab_size, generator=torch.Generator().manual_seed(0)).to(device)
    for threads in map(int, args.threads.split(",")):
        state = grammar.GrammarState(compiler, device)
        state._filler = xgr.BatchGrammarMatcher(threads)
        requests = [[f"{i}.0", 0] for i in range(args.rows)]  # per row: request id, outputs so far
        times: dict[str, float] = defaultdict(float)
        for n in range(args.steps):
            seqs = [SeqPlan(request_id=rid, num_computed_tokens=8 + count, num_scheduled_tokens=1, new_token_ids=[0],
                            block_table=[0], needs_sample=True, sampling=p, num_output_tokens=count)
                    for (rid, count), p in zip(requests, params)]
            t0 = time.perf_counter()
            mask = state.bitmask(seqs)
            t1 = time.perf_counter()
            out = sample(logits[n], params, [None] * args.rows, token_bitmask=mask, to_host=False)
            t2 = time.perf_counter()
            state.accept_later(seqs, out.token_ids)
            t3 = time.perf_counter()
            if n >= WARMUP_STEPS:
                for label, seconds in (("mask", t1 - t0), ("sample", t2 - t1), ("note ids", t3 - t2)):
                    times[label] += seconds
            freed = []
            for row, (rid, count) in enumerate(requests):
                if rid in state._matched and state._matched[rid].matcher.is_terminated():  # past its EOS: a new one
                    freed.append(rid)
                    requests[row] = [f"{row}.{n}", 0]
                else:
                    requests[row][1] += 1
            state.apply_plan(StepPlan(step_id=n, seqs=[], freed=freed))
        if device.type == "cuda":
            torch.cuda.synchronize()
        per = ", ".join(f"{k} {v / (args.steps - WARMUP_STEPS) * 1e3:.3f} ms" for k, v in times.items())
        print(f"{args.rows} rows, {args.constrained} constrained, {threads} fill threads, on {device}: per step {per}")


def _tokenizer(path: str | None):
    """SmolLM2's (the embedded GGUF), or a tokenizer.json whose end-of-text token ends a constraint."""
    from tokenizers import Tokenizer as BackendTokenizer

    from pipeserve.runtime.model.gguf_loader import default_model_path, read_gguf
    from pipeserve.runtime.model.tokenizer import Tokenizer

    if path is None:
        return Tokenizer.from_gguf(read_gguf(default_model_path()))
    backend = BackendTokenizer.from_file(path)
    eos = next(i for t in ("<|end_of_text|>", "<|endoftext|>", "</s>") if (i := backend.token_to_id(t)) is not None)
    return Tokenizer(backend, bos_token_id=None, eos_token_ids=(eos,), add_bos_token=False, chat_template=None)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    e = sub.add_parser("engine")
    e.add_argument("--num-requests", type=int, default=32)
    e.add_argument("--json-fraction", type=float, default=0.25)
    e.add_argument("--max-tokens", type=int, default=64)
    e.add_argument("--rounds", type=int, default=2, help="constrained and plain runs, in turn")
    b = sub.add_parser("batch")
    b.add_argument("--rows", type=int, default=256)
    b.add_argument("--constrained", type=int, default=64)
    b.add_argument("--steps", type=int, default=50)
    b.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    b.add_argument("--threads", default="1", help="xgrammar fill threads to measure, comma-separated")
    b.add_argument("--tokenizer", help="a byte-level tokenizer.json (default: SmolLM2's)")
    args = ap.parse_args(argv)
    engine(args) if args.mode == "engine" else batch(args)


if __name__ == "__main__":
    main()
