"""Gemma 2 / Gemma 3 GGUF files: tiny random transformers models written the way llama.cpp's
convert_hf_to_gguf writes them (norms stored + 1, llama.cpp's tensor names, no lm_head, a
SentencePiece vocabulary without a space prefix). transformers' own GGUF reader gives back the
original model from them (so the files are laid out as llama.cpp's), and so does pipeserve's
loader, with the tokenizer of the SentencePiece model the vocabulary came from."""

import dataclasses
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers_gguf / helpers_model
from helpers_gguf import (  # noqa: E402
    gemma_gguf_metadata,
    gemma_gguf_tokenizer,
    train_sentencepiece,
    write_tiny_gemma_gguf,
    write_tiny_gguf,
)
from helpers_model import PagedRunner, hf_logits, load_hf_reference, write_tiny_checkpoint  # noqa: E402

from pipeserve.runtime.model.gguf_loader import read_gguf  # noqa: E402
from pipeserve.runtime.model.loader import load_model  # noqa: E402
from pipeserve.runtime.model.model_config import ModelConfig  # noqa: E402
from pipeserve.runtime.model.tokenizer import Tokenizer  # noqa: E402

sentencepiece = pytest.importorskip("sentencepiece")

ATOL = 1e-4
# Gemma's special pieces (ids 0-3 as in Gemma: pad, eos, bos, unk), its turn markers, and
# user-defined whitespace pieces: tokenizer_config.json's added_tokens_decoder, content -> special.
SPECIAL = ("<pad>", "<eos>", "<bos>", "<unk>")
ADDED_TOKENS = {**dict.fromkeys(SPECIAL + ("<start_of_turn>", "<end_of_turn>"), True),
                **dict.fromkeys(("\n", "\n\n", "▁▁", "▁▁▁", "▁▁▁▁"), False)}
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
    "def square(x):\n    return x * x  # two spaces before the comment\n\n",
    "Café naïve résumé: 3.14159 and 2024-01-31, fifty-five percent.",
    "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\nParis.<end_of_turn>\n",
] * 25
TEXTS = [
    "Hello world",
    " x",
    "  leading spaces and trailing   ",
    "multiple     spaces\tand\nnewlines\n\n\nend",
    "   \n  \t  ",
    "x\n\n\n\n\ny",
    "Café naïve résumé Ångström ß",
    "日本語のテキスト、中文测试。",  # characters the model never saw: byte fallback
    "emoji 🎉🚀 family 👨‍👩‍👧",
    "<start_of_turn>user\nHi 🎉<end_of_turn>\n<start_of_turn>model\n",
    "",
]
# A Gemma-style chat template: BOS written by the template, "assistant" spoken as "model".
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' "
            "else m['role'] }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
            "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


@pytest.fixture(scope="module")
def sp_model() -> bytes:
    """A SentencePiece BPE model trained as Gemma's is: byte fallback, no dummy prefix,
    whitespace kept, digits split, Gemma's special ids, user-defined turn markers and
    whitespace runs."""
    return train_sentencepiece(
        CORPUS, add_dummy_prefix=False, pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>",
        eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
        user_defined_symbols=[t for t in ADDED_TOKENS if t not in SPECIAL])


@pytest.fixture(scope="module")
def sp(sp_model):
    return sentencepiece.SentencePieceProcessor(model_proto=sp_model)


@pytest.fixture(scope="module")
def vocabulary(sp_model) -> dict:
    return gemma_gguf_tokenizer(sp_model, ADDED_TOKENS) | {"chat_template": TEMPLATE}


def _checkpoint(root: Path, kind: str, vocab_size: int) -> Path:
    """A tiny random Gemma laid out as the released ones whose shape llama.cpp hard-codes:
    head_dim 256 and query_pre_attn_scalar 256 (neither file nor transformers' reader states
    the latter), Gemma 3's every 6th layer global. Sliding windows of 12 keys, shorter than the
    prompts; Gemma 2's soft caps small enough to bend the values; Gemma 3's global layers with
    linear RoPE scaling."""
    shape = {"vocab_size": vocab_size, "head_dim": 256, "query_pre_attn_scalar": 256, "bos_token_id": 2,
             "eos_token_id": 1, "pad_token_id": 0}
    if kind == "gemma3":
        shape |= {"num_hidden_layers": 6, "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}
    return write_tiny_checkpoint(root, kind, seed=7, **shape)


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def gemma(request, tmp_path_factory, vocabulary):
    """(kind, HF folder, GGUF path) of one tiny random Gemma."""
    root = tmp_path_factory.mktemp(request.param)
    folder = _checkpoint(root, request.param, len(vocabulary["tokens"]))
    config = json.loads((folder / "config.json").read_text())
    path = root / f"{request.param}.gguf"
    write_tiny_gemma_gguf(str(path), load_file(folder / "model.safetensors"), config, tokenizer=vocabulary)
    return request.param, folder, path


def _prompt(length: int, vocab_size: int) -> list[int]:
    return torch.randint(4, vocab_size, (length,), generator=torch.Generator().manual_seed(3)).tolist()


# ---- the files are llama.cpp's: transformers' own GGUF reader gives the original model back


def _transformers_from_gguf(path: Path, folder: Path):
    """What `AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)` builds, without the
    `accelerate` it insists on: transformers' config from the file's metadata, and the tensors
    its GGUF loader renames and un-shifts. Its Gemma readers take neither Gemma 2's soft caps
    nor Gemma 3's RoPE scaling from the file (they keep Gemma 2's 50 / 30 and no scaling), so
    those are set from the original config; query_pre_attn_scalar is its default, 256."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    original = json.loads((folder / "config.json").read_text())
    not_read = {"gemma2": ("attn_logit_softcapping", "final_logit_softcapping"), "gemma3_text": ("rope_parameters",)}
    for key in not_read[original["model_type"]]:
        setattr(config, key, original[key])
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied to the embedding
    return model.eval()


def test_transformers_gguf_reader_gives_the_original_model(gemma):
    _, folder, path = gemma
    prompt = _prompt(40, json.loads((folder / "config.json").read_text())["vocab_size"])
    reference = hf_logits(load_hf_reference(folder), prompt)
    assert (hf_logits(_transformers_from_gguf(path, folder), prompt) - reference).abs().max().item() < 1e-5


# ---- pipeserve's loader


def test_weights_and_config_round_trip(gemma):
    """Every tensor comes back under its HF name, the norms less the 1 llama.cpp added (in
    float32, as written), the rest exactly; the config is the original's."""
    _, folder, path = gemma
    state = load_file(folder / "model.safetensors")
    ckpt = read_gguf(str(path))
    got = dict(ckpt.iter_weights())
    assert set(got) == set(state)
    for name, tensor in state.items():
        expected = (tensor + 1) - 1 if name.endswith("norm.weight") else tensor
        assert torch.equal(got[name], expected), name
    ours = ModelConfig.from_hf_dict(ckpt.config)
    # The vocabulary says more about the end of generation than config.json: <end_of_turn> too.
    assert ours.eos_token_ids == (1, ckpt.tokenizer_metadata["tokenizer.ggml.tokens"].index("<end_of_turn>"))
    assert ours == dataclasses.replace(ModelConfig.from_hf_folder(folder), eos_token_ids=ours.eos_token_ids)


@pytest.mark.parametrize("chunk_size", [40, 7])
def test_loaded_gguf_matches_transformers(gemma, chunk_size):
    """The engine's loader on the GGUF file: prefill (whole, or in chunks through the paged
    cache) and greedy decode steps, against transformers on the original checkpoint."""
    _, folder, path = gemma
    loaded = load_model(str(path), dtype=torch.float32, device=torch.device("cpu"))
    hf = load_hf_reference(folder)
    prompt = _prompt(40, loaded.config.vocab_size)
    runner = PagedRunner(loaded.model, seed=chunk_size)
    logits = [runner.step([(0, prompt[i:i + chunk_size])])[0] for i in range(0, len(prompt), chunk_size)]
    tokens = list(prompt)
    for _ in range(6):
        tokens.append(int(logits[-1][-1].argmax()))
        logits.append(runner.step([(0, tokens[-1:])])[0])
    assert (torch.cat(logits) - hf_logits(hf, tokens)).abs().max().item() < ATOL
    assert loaded.tokenizer.eos_token_ids == loaded.config.eos_token_ids


# ---- metadata: what llama.cpp reads, defaults and hard-codes


def _write(tmp_path: Path, kind: str, vocabulary: dict, *, drop: tuple[str, ...] = (), **config) -> str:
    """A GGUF of a tiny Gemma config (no need for its weights beyond the embedding) with the
    converter's metadata, less `drop`."""
    from transformers import Gemma2Config, Gemma3TextConfig

    shape = dict(vocab_size=len(vocabulary["tokens"]), hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, sliding_window=12, max_position_embeddings=256)
    hf = (Gemma2Config if kind == "gemma2" else Gemma3TextConfig)(**(shape | config)).to_dict()
    metadata = {k: v for k, v in gemma_gguf_metadata(hf).items() if k.split(".", 1)[1] not in drop}
    embedding = torch.zeros(hf["vocab_size"], 8)  # only its rows are read: the vocabulary's size
    path = str(tmp_path / f"{kind}.gguf")
    write_tiny_gemma_gguf(path, {"model.embed_tokens.weight": embedding}, hf, tokenizer=vocabulary,
                          metadata=metadata)
    return path


def test_gemma2_metadata(tmp_path, vocabulary):
    config = read_gguf(_write(tmp_path, "gemma2", vocabulary, num_hidden_layers=4, attn_logit_softcapping=20.0,
                              final_logit_softcapping=10.0, sliding_window=64)).config
    model = ModelConfig.from_hf_dict(config)
    assert model.architecture == "Gemma2ForCausalLM" and model.is_gemma and model.hidden_act == "gelu_pytorch_tanh"
    assert (model.attn_logit_softcapping, model.final_logit_softcapping, model.sliding_window) == (20.0, 10.0, 64)
    assert model.layer_windows == (64, None, 64, None)  # alternating, sliding first
    assert model.head_dim == 32 and model.query_pre_attn_scalar == 32.0  # head_dim, not hidden / heads = 16
    assert model.rope_theta == 10000.0 and model.local_rope_theta is None and model.tie_word_embeddings

    # What the converter always writes but llama.cpp can do without: its defaults, Gemma 2's values.
    defaults = ModelConfig.from_hf_dict(read_gguf(_write(
        tmp_path, "gemma2", vocabulary, num_hidden_layers=4,
        drop=("attn_logit_softcapping", "final_logit_softcapping", "attention.sliding_window"))).config)
    assert (defaults.attn_logit_softcapping, defaults.final_logit_softcapping, defaults.sliding_window) == (
        50.0, 30.0, 4096)


def test_gemma3_metadata(tmp_path, vocabulary):
    rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    model = ModelConfig.from_hf_dict(read_gguf(_write(
        tmp_path, "gemma3", vocabulary, num_hidden_layers=12, rope_parameters=rope)).config)
    assert model.architecture == "Gemma3ForCausalLM" and model.qk_norm and model.attn_logit_softcapping is None
    assert model.layer_windows == ((12,) * 5 + (None,)) * 2  # every 6th layer global
    assert model.rope_theta == 1e6 and model.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert model.local_rope_theta == 10000.0 and model.final_logit_softcapping is None

    # No window: every layer global (a sliding_window_pattern of 1); a final cap when given.
    model = ModelConfig.from_hf_dict(read_gguf(_write(
        tmp_path, "gemma3", vocabulary, num_hidden_layers=6, final_logit_softcapping=30.0,
        drop=("attention.sliding_window",))).config)
    assert model.layer_windows == (None,) * 6 and model.final_logit_softcapping == 30.0


@pytest.mark.parametrize(("kind", "layers", "hidden", "heads", "head_dim", "scalar"), [
    ("gemma2", 46, 4608, 32, 128, 144),  # Gemma 2 27B: its config.json's query_pre_attn_scalar
    ("gemma3", 62, 5376, 32, 128, 168),  # Gemma 3 27B
    ("gemma2", 42, 3584, 16, 256, 256),  # Gemma 2 9B: head_dim (hidden / heads is 224)
    ("gemma3", 34, 2560, 8, 256, 256),  # Gemma 3 4B
])
def test_query_pre_attn_scalar_as_llama_cpp(tmp_path, vocabulary, kind, layers, hidden, heads, head_dim, scalar):
    """The file does not say it: llama.cpp scales by head_dim, but by hidden / heads in the 27B
    models, which it knows by their layer count. The shapes are the released models'."""
    path = _write(tmp_path, kind, vocabulary, num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                  num_key_value_heads=heads // 2, head_dim=head_dim)
    assert ModelConfig.from_hf_dict(read_gguf(path).config).query_pre_attn_scalar == scalar


@pytest.mark.parametrize("key", ["attention.key_length", "embedding_length", "attention.head_count",
                                 "feed_forward_length", "block_count", "context_length"])
def test_missing_metadata_is_a_clear_error(tmp_path, vocabulary, key):
    path = _write(tmp_path, "gemma2", vocabulary, drop=(key,))
    with pytest.raises(ValueError, match=f"GGUF metadata lacks gemma2.{key}"):
        read_gguf(path)


def test_unknown_gemma_tensor_is_a_clear_error(tmp_path):
    path = str(tmp_path / "gemma3.gguf")
    zeros = np.zeros((4, 8), dtype=np.float32)
    write_tiny_gguf(path, "gemma3", {"token_embd.weight": zeros, "per_layer_token_embd.weight": zeros})  # Gemma 3n's
    with pytest.raises(ValueError, match="unsupported GGUF tensor 'per_layer_token_embd.weight'"):
        read_gguf(path)


# ---- the vocabulary


@pytest.fixture(scope="module")
def gemma_gguf(vocabulary, tmp_path_factory) -> str:
    return _write(tmp_path_factory.mktemp("vocab"), "gemma3", vocabulary)


@pytest.mark.parametrize("text", TEXTS)
def test_vocabulary_matches_sentencepiece(gemma_gguf, sp, text):
    """llama.cpp's SentencePiece tokenizer without the space prefix is the model's own: the same
    ids (user-defined whitespace runs, newlines and turn markers whole, byte fallback), the same
    text back, BOS first."""
    ours = Tokenizer.from_gguf(gemma_gguf)
    ids = sp.encode(text)
    assert ours.encode(text, add_special_tokens=False) == ids
    assert ours.add_bos_token and ours.encode(text) == [sp.bos_id(), *ids]
    assert ours.decode(ids, skip_special_tokens=False) == sp.decode(ids) == text
    assert ours.decode([sp.bos_id(), *ids], skip_special_tokens=False) == "<bos>" + text


def test_vocabulary_special_tokens_and_chat_template(gemma_gguf, sp):
    ours = Tokenizer.from_gguf(gemma_gguf)
    start, end = sp.piece_to_id("<start_of_turn>"), sp.piece_to_id("<end_of_turn>")
    assert (ours.bos_token_id, ours.eos_token_ids) == (2, (1, end))  # <eos>, then <end_of_turn>
    assert {0, 1, 2, 3, start, end} <= set(ours.all_special_ids)
    assert sp.piece_to_id("▁▁") not in ours.all_special_ids  # user-defined, not special
    messages = [{"role": "user", "content": "Hi 🎉"}, {"role": "assistant", "content": "Paris."}]
    text = ours.apply_chat_template(messages)
    assert text == ("<bos><start_of_turn>user\nHi 🎉<end_of_turn>\n<start_of_turn>model\nParis.<end_of_turn>\n"
                    "<start_of_turn>model\n")
    ids = ours.apply_chat_template(messages, tokenize=True)
    assert ids == [2, *sp.encode(text.removeprefix("<bos>"))]  # SentencePiece matches the markers too
    assert ours.decode(ids) == "user\nHi 🎉\nmodel\nParis.\nmodel\n"
    # A marker's text in a message stays text: the one <end_of_turn> is the template's.
    assert ours.apply_chat_template([{"role": "user", "content": "<end_of_turn>"}], tokenize=True).count(end) == 1


def test_vocabulary_matches_transformers_gguf_tokenizer(gemma_gguf):
    """transformers' GGUF tokenizer for Gemma encodes as llama.cpp and SentencePiece do, except a
    run of spaces longer than the longest whitespace piece: it respells those pieces "▁▁"... and
    merges them, so five spaces before a word become "▁▁" "▁▁▁", where SentencePiece (and this
    tokenizer, test_vocabulary_matches_sentencepiece) takes the longest piece first, "▁▁▁▁" "▁s"."""
    from transformers import AutoTokenizer

    ours = Tokenizer.from_gguf(gemma_gguf)
    reference = AutoTokenizer.from_pretrained(os.path.dirname(gemma_gguf), gguf_file=os.path.basename(gemma_gguf))
    for text in TEXTS:
        if " " * 5 in text:
            continue
        assert ours.encode(text) == reference.encode(text), text
        assert ours.decode(ours.encode(text)) == reference.decode(reference.encode(text), skip_special_tokens=True)
