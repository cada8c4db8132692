"""Text <-> token ids, chat templates, and streaming detokenization.

    tokenizer = Tokenizer.from_gguf(checkpoint)            # or Tokenizer.from_hf_folder(folder)
    prompt_ids = tokenizer.apply_chat_template(messages, tokenize=True)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    for token_id in generated:
        print(detok.step(token_id), end="")

`Tokenizer` wraps a `tokenizers.Tokenizer` and adds BOS itself (never through the backend's
post-processor), so one flag, `add_bos_token`, says what `encode` does for every source.
"""

import json
import os
import re
import uuid
from datetime import datetime
from functools import cached_property
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from pipeserve.runtime.model.gguf_loader import GGUFCheckpoint, gguf_eos_token_ids, read_gguf

# llama.cpp token types (gguf.TokenType).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> (split regexes applied in order, ignore_merges), as llama.cpp's
# llama-vocab.cpp does. "smollm" (and the StarCoder family) isolate every digit first, exactly
# like the Digits(individual_digits=True) step of SmolLM2's own tokenizer.json. transformers'
# GGUF converter is not used instead: it maps "smollm" to plain GPT-2 splitting (another
# encoding of a whitespace run before a digit, see test_smollm2_encode_decode_match_transformers),
# its qwen2 / llama-bpe digit splitting changed between 5.17 and 5.24, and transformers is not a
# runtime dependency.
_PRE_TOKENIZERS = {
    **dict.fromkeys(["gpt2", "gpt-2", "mpt", "olmo", "jais"], ([_GPT2_SPLIT], False)),
    **dict.fromkeys(
        ["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"],
        ([r"\p{N}", _GPT2_SPLIT], False),
    ),
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"], ([_LLAMA3_SPLIT], True)),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "megrez"], ([_QWEN2_SPLIT], False)),
}


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the model's special-token and chat-template conventions."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: tuple[int, ...],
        add_bos_token: bool,
        chat_template: str | None,
    ):
        """`eos_token_ids[0]` is the primary EOS; the rest also end generation."""
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        if add_bos_token and bos_token_id is None:
            raise ValueError("add_bos_token is set but the tokenizer has no BOS token")
        # skip_special_tokens -> {token id: decode([token id])}, filled by token_text.
        self._token_texts: dict[bool, dict[int, str]] = {True: {}, False: {}}

    # ---- constructors

    @classmethod
    def from_gguf(cls, checkpoint_or_path: GGUFCheckpoint | str) -> "Tokenizer":
        """Build the tokenizer a GGUF file describes: byte-level BPE (`tokenizer.ggml.model`
        "gpt2") or SentencePiece ("llama": Llama 2, Mistral v0.1, TinyLlama, Gemma 2 / 3)."""
        checkpoint = checkpoint_or_path
        if not isinstance(checkpoint, GGUFCheckpoint):
            checkpoint = read_gguf(checkpoint)
        meta = checkpoint.tokenizer_metadata
        model = meta.get("tokenizer.ggml.model")
        builders = {"gpt2": _byte_level_bpe_from_gguf, "llama": _sentencepiece_bpe_from_gguf}
        if model not in builders:
            raise ValueError(f"{checkpoint.path}: GGUF tokenizer model {model!r} is unsupported "
                             f"(supported: byte-level BPE 'gpt2', SentencePiece 'llama')")
        # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise.
        add_bos = meta.get("tokenizer.ggml.add_bos_token", model == "llama")
        return cls(
            builders[model](meta),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=gguf_eos_token_ids(meta),
            add_bos_token=bool(add_bos),
            chat_template=meta.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_hf_folder(cls, path: str) -> "Tokenizer":
        """Load tokenizer.json, plus tokenizer_config.json, chat_template.jinja,
        generation_config.json and config.json when present."""
        tokenizer_file = os.path.join(path, "tokenizer.json")
        if os.path.isfile(os.path.join(path, "tokenizer.model")) and not os.path.isfile(tokenizer_file):
            # Converting a SentencePiece protobuf needs transformers, sentencepiece and protobuf;
            # nearly every published folder ships the converted tokenizer.json beside it.
            raise ValueError(
                f"{path} has a SentencePiece tokenizer.model but no tokenizer.json; convert it once with "
                f"`pip install transformers sentencepiece protobuf` and `python -c \"from transformers import "
                f"AutoTokenizer; AutoTokenizer.from_pretrained('{path}').save_pretrained('{path}')\"`"
            )
        if not os.path.isfile(tokenizer_file):
            raise ValueError(f"{path} has no tokenizer.json")
        backend = BackendTokenizer.from_file(tokenizer_file)
        tok_config = _read_json(path, "tokenizer_config.json")
        bos_token_id, eos_ids = _hf_special_token_ids(path, backend, tok_config)
        add_bos = tok_config.get("add_bos_token")
        if add_bos is None:  # no flag: whatever tokenizer.json's post-processor does
            add_bos = bos_token_id is not None and backend.encode("").ids[:1] == [bos_token_id]
        # We add BOS ourselves; the post-processor would add it a second time.
        backend.post_processor = None
        return cls(
            backend,
            bos_token_id=bos_token_id,
            eos_token_ids=eos_ids,
            add_bos_token=add_bos,
            chat_template=_hf_chat_template(path, tok_config),
        )

    # ---- vocabulary

    @property
    def vocab_size(self) -> int:
        """Token count, added tokens included. The model's embedding may have more (padding) rows."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @cached_property
    def all_special_ids(self) -> list[int]:
        """Ids of special added tokens (control tokens) plus BOS and EOS, sorted."""
        special = {i for i, token in self.backend.get_added_tokens_decoder().items() if token.special}
        special.update(self.eos_token_ids)
        if self.bos_token_id is not None:
            special.add(self.bos_token_id)
        return sorted(special)

    def id_to_token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)

    # ---- text <-> ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in it (e.g. "<|im_start|>") are matched whole.
        BOS is prepended only if `add_special_tokens` and the model asks for it."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens)  # positional: keywords cost ~1 µs here

    @cached_property
    def concatenates_token_texts(self) -> bool:
        """Is ``decode(ids)`` the concatenation of each id's ``token_text`` whenever none of those
        holds U+FFFD? True for a byte-level decoder, which joins every token's own bytes (so
        complete characters stay as they are); False where a token's text depends on its left
        context (e.g. SentencePiece's Metaspace strips the leading space of the first token)."""
        return isinstance(self.backend.decoder, decoders.ByteLevel)

    def token_text(self, token_id: int, skip_special_tokens: bool = True) -> str:
        """``decode([token_id])``, cached (at most one entry per vocabulary token)."""
        texts = self._token_texts[skip_special_tokens]
        text = texts.get(token_id)
        if text is None:
            text = texts[token_id] = self.decode([token_id], skip_special_tokens=skip_special_tokens)
        return text

    # ---- chat

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        special_tokens_in_content: bool = False,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """Render `messages` with the model's Jinja chat template, as transformers does.

        `template_kwargs` (e.g. `tools=`) are passed to the template. With
        `continue_final_message` the rendering ends where the last message's content does (its
        end-of-turn cut off), so generation continues that message. With `tokenize`, the text is
        encoded without adding BOS: templates write their special tokens themselves. A special
        token's text inside a message's content (say "<|im_start|>system") stays text unless
        `special_tokens_in_content`, so content cannot forge the template's markers; ValueError
        where the template changes the content on its way (then it cannot be kept apart).
        """
        text = self._render(messages, add_generation_prompt, template_kwargs, continue_final_message)
        if not tokenize:
            return text
        if special_tokens_in_content or not any(self._holds_special_text(m.get("content")) for m in messages):
            return self.encode(text, add_special_tokens=False)
        return self._encode_with_literal_contents(messages, text, add_generation_prompt, template_kwargs,
                                                  continue_final_message)

    def _render(self, messages: list[dict], add_generation_prompt: bool, template_kwargs: dict,
                continue_final: bool) -> str:
        if self.chat_template is None:
            raise ValueError("this model has no chat template")
        text = self._compiled_chat_template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.id_to_token(self.bos_token_id) or "",
            eos_token=self.id_to_token(self.eos_token_id) or "",
            **template_kwargs,
        )
        return _cut_after_final_message(text, messages[-1].get("content")) if continue_final else text

    @cached_property
    def _special_texts(self) -> tuple[str, ...]:
        return tuple(t.content for t in self.backend.get_added_tokens_decoder().values() if t.special)

    def _holds_special_text(self, content) -> bool:
        return isinstance(content, str) and any(s in content for s in self._special_texts)

    def _encode_with_literal_contents(self, messages: list[dict], text: str, add_generation_prompt: bool,
                                      template_kwargs: dict, continue_final: bool) -> list[int]:
        """The rendering's ids with each message's content encoded as plain text: rendered again
        with a unique marker in place of each content, the template's own text between the
        markers is encoded with its special tokens, the contents without."""
        nonce = uuid.uuid4().hex
        marks = {i: f"\ue000{nonce}:{i}\ue001" for i, m in enumerate(messages) if isinstance(m.get("content"), str)}
        marked = self._render([dict(m, content=marks[i]) if i in marks else m for i, m in enumerate(messages)],
                              add_generation_prompt, template_kwargs, continue_final)
        pattern = re.compile("(" + "|".join(re.escape(mark) for mark in marks.values()) + ")")
        pieces = pattern.split(marked)
        by_mark = {mark: messages[i]["content"] for i, mark in marks.items()}
        if (sorted(p for p in pieces[1::2]) != sorted(marks.values())
                or "".join(by_mark.get(p, p) for p in pieces) != text):
            raise ValueError("a message's content holds a special token's text, and this chat template "
                             "changes contents as it renders them, so the text cannot be kept apart from "
                             "its markers; remove it, or send prompt token ids")
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if i % 2 == 0:
                ids += self.backend.encode(piece, add_special_tokens=False).ids
            else:
                ids += self._encode_literally(by_mark[piece])
        return ids

    def _encode_literally(self, text: str) -> list[int]:
        """Ids of `text` with special tokens' texts taken as plain text."""
        self.backend.encode_special_tokens = True
        try:
            return self.backend.encode(text, add_special_tokens=False).ids
        finally:
            self.backend.encode_special_tokens = False

    @cached_property
    def _compiled_chat_template(self) -> jinja2.Template:
        return _chat_environment().from_string(self.chat_template)


class IncrementalDetokenizer:
    """Streams the text of generated tokens, one token at a time.

    Decodes a sliding window `[prefix_offset, read_offset)` of already-emitted tokens together with
    the new ones, and emits what the new ones add, so that spacing rules depending on the left
    context are honoured (the vLLM / TextStreamer scheme). Text ending in U+FFFD (an incomplete
    UTF-8 sequence split across tokens) is held back until the sequence completes.

    Kept over `tokenizers.decoders.DecodeStream` (the same scheme in Rust): `tools/detok_cost.py`
    found both give the same text at every step (SmolLM2's byte-level BPE and a SentencePiece
    BPE, both ways of skip_special_tokens), but its timings on a shared CPU so far favoured
    whichever of the two it timed second (1-4 against 4-14 µs per token), so no speed-up is shown.
    """

    # How many prompt tokens to decode as left context for the first output token.
    _NUM_PROMPT_CONTEXT_TOKENS = 5

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_token_ids[-self._NUM_PROMPT_CONTEXT_TOKENS :])
        self.prefix_offset = 0
        self.read_offset = len(self._ids)
        self._num_prompt_ids = len(self._ids)
        self._text = ""

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return self._text

    @property
    def output_token_ids(self) -> list[int]:
        return self._ids[self._num_prompt_ids :]

    def step(self, new_token_id: int) -> str:
        """Add one token; return the text it finalizes ("" while a character is incomplete)."""
        self._ids.append(new_token_id)
        delta = self._token_delta()
        if delta is None:
            return self._emit(hold_incomplete=True)
        self.prefix_offset, self.read_offset = self.read_offset, len(self._ids)
        self._text += delta
        return delta

    def _token_delta(self) -> str | None:
        """What ``_emit`` would return, without decoding, in the usual case: the window is the
        last token emitted and the new one, and the tokenizer concatenates complete token texts
        (then decode(window) == text(previous) + text(new)). None otherwise."""
        if len(self._ids) - self.read_offset != 1 or self.read_offset - self.prefix_offset != 1:
            return None
        tokenizer, skip = self.tokenizer, self.skip_special_tokens
        if not tokenizer.concatenates_token_texts:
            return None
        new_text = tokenizer.token_text(self._ids[-1], skip)
        if not new_text or "\ufffd" in new_text or "\ufffd" in tokenizer.token_text(self._ids[-2], skip):
            return None  # nothing new (_emit keeps its offsets), or an incomplete character
        return new_text

    def flush(self) -> str:
        """Any held-back text, once the sequence has finished."""
        return self._emit(hold_incomplete=False)

    def _emit(self, hold_incomplete: bool) -> str:
        tokenizer, skip = self.tokenizer, self.skip_special_tokens
        if self.read_offset - self.prefix_offset == 1:  # the usual case once tokens stream
            prefix_text = tokenizer.token_text(self._ids[self.prefix_offset], skip)
        else:
            prefix_text = tokenizer.decode(self._ids[self.prefix_offset : self.read_offset], skip)
        new_text = tokenizer.decode(self._ids[self.prefix_offset :], skip)
        if len(new_text) <= len(prefix_text) or (hold_incomplete and new_text.endswith("\ufffd")):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self._ids)
        self._text += delta
        return delta


# ---- GGUF byte-level BPE


def _byte_level_bpe_from_gguf(meta: dict[str, Any]) -> BackendTokenizer:
    pre = meta.get("tokenizer.ggml.pre", "gpt2")
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is unsupported; supported: {sorted(_PRE_TOKENIZERS)}")
    splits, ignore_merges = _PRE_TOKENIZERS[pre]
    tokens = meta["tokenizer.ggml.tokens"]
    token_types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    added = {
        index: AddedToken(token, special=kind == _CONTROL, normalized=False)
        for index, (token, kind) in enumerate(zip(tokens, token_types))
        if kind in (_CONTROL, _USER_DEFINED)
    }
    added_contents = {t.content for t in added.values()}
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())

    def vocab_key(token: str) -> str:
        # Added tokens keep their text (so add_special_tokens finds their id); any other token
        # stored as plain text is respelled in the byte alphabet the BPE model works in.
        if token in added_contents or set(token) <= alphabet:
            return token
        return "".join(spelling[b] for b in token.encode("utf-8"))

    vocab = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(vocab_key(token), index)
    merges = [tuple(merge.split(" ", 1)) for merge in meta.get("tokenizer.ggml.merges", [])]
    backend = BackendTokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    backend.add_tokens(list(added.values()))
    for token in added.values():  # found in the vocab, so no new id was appended
        assert backend.token_to_id(token.content) == vocab[token.content], token.content
    return backend


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


# ---- GGUF SentencePiece ("llama")


def _sentencepiece_bpe_from_gguf(meta: dict[str, Any]) -> BackendTokenizer:
    """llama.cpp's SPM vocabulary (a SentencePiece BPE model's pieces, scores and token types) as
    a `tokenizers` BPE with byte fallback, tokenizing as llama.cpp does.

    Spaces become "▁", and with `add_space_prefix` (on unless the file says otherwise) a "▁" is
    prepended to the text and to every run of text after a special token: llama.cpp does so
    (`is_prev_special`), and a normalizer runs on each run between added tokens, so Prepend does
    exactly that. (transformers' GGUF converter prepends at the very start only, which differs
    from llama.cpp on chat prompts: "<s>[INST]" must encode "[INST]" as "▁[INST]".) Gemma's
    files turn the prefix off, and store its user-defined pieces of whitespace ("▁▁", ...) as
    spaces: like every user-defined piece they are added tokens, matched whole in the raw text
    before the BPE runs, as llama.cpp and SentencePiece match them.
    """
    tokens = meta["tokenizer.ggml.tokens"]
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None:
        raise ValueError("GGUF SentencePiece vocabulary without tokenizer.ggml.scores")
    types = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id", next((i for i, t in enumerate(types) if t == _UNKNOWN), None))
    backend = BackendTokenizer(models.BPE(
        vocab, _merges_by_score(vocab, scores, types), unk_token=None if unk_id is None else tokens[unk_id],
        fuse_unk=True, byte_fallback=True,
    ))
    add_space_prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    prefix = [normalizers.Prepend("▁")] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", "▁")])
    # The decoders mirror: "▁" back to spaces, <0xNN> pieces to bytes, then the prefix space off.
    strip = [decoders.Strip(" ", 1, 0)] if add_space_prefix else []
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )
    backend.add_tokens([
        AddedToken(token, special=kind in (_CONTROL, _UNKNOWN), normalized=False)
        for token, kind in zip(tokens, types) if kind in (_CONTROL, _UNKNOWN, _USER_DEFINED)
    ])
    return backend


def _merges_by_score(vocab: dict[str, int], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """The merges a SentencePiece BPE vocabulary implies, best first.

    SentencePiece (and llama.cpp) merge, at each step, the adjacent pair whose concatenation is
    the best-scoring piece; a `tokenizers` BPE merges the pair of lowest rank. So every split of
    a piece into two pieces is a merge ranked by the piece's score (transformers' converter does
    the same, with the same tie order). Only normal pieces are merged from or into: control,
    byte and user-defined pieces are whole symbols.
    """
    ranked = []
    for piece, index in vocab.items():
        if types[index] != _NORMAL:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            left_id, right_id = vocab.get(left), vocab.get(right)
            if left_id is not None and right_id is not None and types[left_id] == types[right_id] == _NORMAL:
                ranked.append((-scores[index], -len(left), -len(right), index, left_id, right_id, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


# ---- HF folder helpers


def _read_json(folder: str, name: str) -> dict:
    file = os.path.join(folder, name)
    if not os.path.isfile(file):
        return {}
    with open(file, encoding="utf-8") as f:
        return json.load(f)


def _hf_special_token_ids(
    folder: str, backend: BackendTokenizer, tok_config: dict
) -> tuple[int | None, tuple[int, ...]]:
    """(BOS id, EOS ids): tokenizer_config.json first, then generation_config.json, config.json."""

    def token_id(value: str | dict | None) -> int | None:
        content = value.get("content") if isinstance(value, dict) else value  # str or AddedToken dict
        return None if content is None else backend.token_to_id(content)

    configs = [_read_json(folder, name) for name in ("generation_config.json", "config.json")]
    bos_token_id = token_id(tok_config.get("bos_token"))
    if bos_token_id is None:
        bos_token_id = next((c["bos_token_id"] for c in configs if c.get("bos_token_id") is not None), None)
    eos_ids = [token_id(tok_config.get("eos_token"))]
    for config in configs:
        config_eos = config.get("eos_token_id")
        eos_ids += config_eos if isinstance(config_eos, list) else [config_eos]
    return bos_token_id, _unique(eos_ids)


def _hf_chat_template(folder: str, tok_config: dict) -> str | None:
    jinja_file = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read()
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        template = {t["name"]: t["template"] for t in template}.get("default")
    return template


def _unique(ids: list[int | None]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(i for i in ids if i is not None))


# ---- Jinja environment (transformers' chat-template conventions)


def _cut_after_final_message(text: str, content) -> str:
    """``text`` up to the end of the last message's content, as transformers'
    ``continue_final_message`` does (a template may strip the content's outer whitespace)."""
    if not isinstance(content, str) or not content.strip() or content.strip() not in text:
        raise ValueError("continue_final_message: the last message's content does not appear in the "
                         "rendered chat")
    start = text.rindex(content.strip())
    if text[start:start + len(content.lstrip())] == content.lstrip():
        return text[:start + len(content.lstrip())]
    return text[:start + len(content.strip())]


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson HTML-escapes '<', '>' and '&', which templates with tool schemas must not.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _chat_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
