"""The benchmarks' random-weights model folder (runtime/bench/dummy_model.py): its generated
tokenizer has GPT-2's 50257 entries with EOS where config.json says, and loads in transformers
(as the peer benchmark does: AutoTokenizer, PreTrainedTokenizerFast) and in pipeserve."""

from __future__ import annotations

import json

import pytest

from pipeserve.runtime.bench.dummy_model import (
    GPT2_VOCAB,
    SHAPES,
    DummyModelConfig,
    with_dummy_model,
    write_model_folder,
)
from pipeserve.runtime.config import EngineConfig
from pipeserve.runtime.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("dummy") / "llama3-8b"
    write_model_folder(str(path), shape="llama3-8b", num_layers=2)
    return path


def test_config_is_the_shape_with_its_layers(folder):
    config = json.loads((folder / "config.json").read_text())
    assert config == {**SHAPES["llama3-8b"], "num_hidden_layers": 2}
    assert (config["hidden_size"], config["intermediate_size"], config["num_key_value_heads"]) == (4096, 14336, 8)
    assert config["vocab_size"] >= GPT2_VOCAB == 50257


def test_transformers_loads_the_tokenizer(folder):
    transformers = pytest.importorskip("transformers")
    config = json.loads((folder / "config.json").read_text())
    for cls in (transformers.AutoTokenizer, transformers.PreTrainedTokenizerFast):
        tok = cls.from_pretrained(str(folder))
        assert len(tok) == GPT2_VOCAB
        assert tok.eos_token_id == tok.bos_token_id == config["eos_token_id"] == GPT2_VOCAB - 1
        assert tok.encode("w7 w50255 <|endoftext|>", add_special_tokens=False) == [7, 50255, 50256]
        assert tok.decode([3, 4, 5]) == "w3 w4 w5"


def test_pipeserve_loads_the_tokenizer(folder):
    tok = Tokenizer.from_hf_folder(str(folder))
    assert tok.vocab_size == GPT2_VOCAB and tok.eos_token_ids == (GPT2_VOCAB - 1,) and not tok.add_bos_token
    assert tok.encode("w0 w1 w2") == [0, 1, 2]


def test_engine_config_points_at_the_folder(tmp_path):
    engine = EngineConfig(model="some/model")
    assert with_dummy_model(engine, DummyModelConfig(), str(tmp_path)) is engine  # no shape: unchanged
    dummy = with_dummy_model(engine, DummyModelConfig(shape="llama3-70b", num_layers=3), str(tmp_path))
    assert dummy.model == str(tmp_path / "dummy_model") and dummy.load_format == "dummy"
    assert json.loads((tmp_path / "dummy_model" / "config.json").read_text())["hidden_size"] == 8192


def test_a_given_tokenizer_is_shipped_instead(folder, tmp_path):
    write_model_folder(str(tmp_path), num_layers=1, tokenizer=str(folder / "tokenizer.json"))
    assert (tmp_path / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    with pytest.raises(ValueError, match="does not exist"):
        write_model_folder(str(tmp_path), num_layers=1, tokenizer=str(tmp_path / "missing.json"))


def test_bad_values_are_clear_errors():
    with pytest.raises(ValueError, match="dummy_model.shape must be one of"):
        DummyModelConfig(shape="llama3-7b")
    with pytest.raises(ValueError, match="num_layers"):
        DummyModelConfig(shape="llama3-8b", num_layers=0)
