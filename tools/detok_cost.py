"""Streaming detokenization: `IncrementalDetokenizer` against `tokenizers.decoders.DecodeStream`.

    python -m tools.detok_cost                        # 100k tokens per tokenizer
    python -m tools.detok_cost --num-tokens 20000

Streams the token ids of real text (this repository's docs and README, repeated to
`--num-tokens`, an end-of-turn token every 1000) through both, one token at a time after a chat
prompt, and prints, per tokenizer and `skip_special_tokens`: the microseconds per token of each
(CPU time, best of `--repeats`: the machine may be shared), and how many steps returned
different text (DecodeStream's None counted as ""). Two tokenizers:
SmolLM2's byte-level BPE (the embedded GGUF), and a SentencePiece BPE (byte fallback, dummy
prefix) trained here on the same text with the `sentencepiece` package and converted to
tokenizer.json by transformers, as published Llama 2 / Mistral folders are (needs
`sentencepiece` and `protobuf`).
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from tokenizers.decoders import DecodeStream

from pipeserve.runtime.model.gguf_loader import default_model_path
from pipeserve.runtime.model.tokenizer import IncrementalDetokenizer, Tokenizer

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [{"role": "user", "content": "Tell me about pipeserve."}]


def corpus() -> str:
    return "\n\n".join(p.read_text(encoding="utf-8") for p in [ROOT / "README.md", *sorted(ROOT.glob("docs/*.md"))])


def smollm2() -> Tokenizer:
    return Tokenizer.from_gguf(default_model_path())


def sentencepiece_bpe(text: str, folder: str) -> Tokenizer:
    import sentencepiece
    from transformers import AutoTokenizer

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(text.splitlines()), model_writer=model, model_type="bpe", vocab_size=4000,
        byte_fallback=True, character_coverage=0.9995, remove_extra_whitespaces=False, split_digits=True,
        normalization_rule_name="identity", minloglevel=2,
    )
    (Path(folder) / "tokenizer.model").write_bytes(model.getvalue())
    (Path(folder) / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "legacy": False,
        "chat_template": "{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}",
    }))
    AutoTokenizer.from_pretrained(folder).save_pretrained(folder)
    return Tokenizer.from_hf_folder(folder)


def stream_ours(tokenizer: Tokenizer, prompt: list[int], output: list[int], skip: bool) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    return [detok.step(token) for token in output]


def stream_decode_stream(tokenizer: Tokenizer, prompt: list[int], output: list[int], skip: bool) -> list[str]:
    stream, backend = DecodeStream(ids=prompt[-IncrementalDetokenizer._NUM_PROMPT_CONTEXT_TOKENS:],
                                   skip_special_tokens=skip), tokenizer.backend
    return [stream.step(backend, token) or "" for token in output]


def best_us_per_token(run: Callable[[], list[str]], num_tokens: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        run()
        best = min(best, time.process_time() - start)
    return best / num_tokens * 1e6


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-tokens", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    text = corpus()
    with tempfile.TemporaryDirectory() as folder:
        tokenizers = {"smollm2 (byte-level BPE)": smollm2(), "sentencepiece BPE": sentencepiece_bpe(text, folder)}
        print(f"{'tokenizer':26} {'skip':>5} {'ours µs/tok':>12} {'DecodeStream µs/tok':>20} {'steps differing':>16}")
        for name, tokenizer in tokenizers.items():
            ids = tokenizer.encode(text, add_special_tokens=False)
            output = (ids * (args.num_tokens // len(ids) + 1))[: args.num_tokens]
            # The end-of-turn token as the model writes it, so special tokens are in the stream.
            output[1000::1000] = [tokenizer.eos_token_id] * len(output[1000::1000])
            prompt = tokenizer.apply_chat_template(PROMPT, tokenize=True)
            for skip in (True, False):
                ours = stream_ours(tokenizer, prompt, output, skip)
                theirs = stream_decode_stream(tokenizer, prompt, output, skip)
                differing = sum(a != b for a, b in zip(ours, theirs))
                ours_us = best_us_per_token(lambda: stream_ours(tokenizer, prompt, output, skip), len(output),
                                            args.repeats)
                theirs_us = best_us_per_token(lambda: stream_decode_stream(tokenizer, prompt, output, skip),
                                              len(output), args.repeats)
                print(f"{name:26} {skip!s:>5} {ours_us:12.2f} {theirs_us:20.2f} {differing:16d}")


if __name__ == "__main__":
    main()
