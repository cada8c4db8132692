"""Hugging Face hub ids: `LLM("org/name")` through huggingface_hub against a hub cache this test
lays out itself (blobs, snapshots of symlinks, refs/main; the weights sharded behind an index),
offline (`HF_HUB_OFFLINE=1`), in fresh processes so that huggingface_hub reads `HF_HOME` at
import. The outputs are those of the same checkpoint given as a folder."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_model import write_tiny_model
from safetensors.torch import load_file, save_file

from pipeserve.runtime.model import hub

COMMIT = "0123456789abcdef0123456789abcdef01234567"
GENERATE = """
import json, sys
from pipeserve import LLM, SamplingParams
kwargs = json.loads(sys.argv[2])
llm = LLM(sys.argv[1], device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=128, **kwargs)
outs = llm.generate([[5, 6, 7, 8], [9, 10]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
print("TOKENS", json.dumps([o.outputs[0].token_ids for o in outs]))
"""


def shard(folder: Path) -> None:
    """model.safetensors -> two shards and model.safetensors.index.json, as large checkpoints are."""
    tensors = load_file(folder / "model.safetensors")
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (folder / "model.safetensors").unlink()


def lay_out_hub_cache(hf_home: Path, repo_id: str, folder: Path) -> Path:
    """HF_HOME/hub/models--org--name/: each file a blob named by its hash, the snapshot of
    COMMIT a folder of symlinks to them, refs/main naming COMMIT (huggingface_hub's layout)."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in folder.iterdir():
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, repo / "blobs" / digest)
        (snap / f.name).symlink_to(Path("../../blobs") / digest)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snap


def generate(model: str, hf_home: Path, **kwargs) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HOME=str(hf_home), HF_HUB_OFFLINE="1")
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run([sys.executable, "-c", GENERATE, model, json.dumps(kwargs)], env=env,
                          capture_output=True, text=True, timeout=300)


def tokens(proc: subprocess.CompletedProcess):
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("TOKENS"))[7:])


@pytest.mark.timeout(600)
def test_hub_id_from_the_cache_offline_gives_the_folders_outputs(tmp_path):
    folder = Path(write_tiny_model(tmp_path / "ckpt"))
    shard(folder)
    hf_home = tmp_path / "hf"
    snap = lay_out_hub_cache(hf_home, "tiny-org/tiny-llama", folder)
    want = tokens(generate(str(folder), hf_home))
    assert tokens(generate("tiny-org/tiny-llama", hf_home)) == want
    assert tokens(generate("tiny-org/tiny-llama", hf_home, revision=COMMIT)) == want
    missing = generate("tiny-org/not-cached", hf_home)
    assert missing.returncode != 0
    assert "'tiny-org/not-cached' is not in the Hugging Face cache" in missing.stderr
    assert "HF_HUB_OFFLINE is set" in missing.stderr
    assert hub.repo_id_of(str(snap)) == "tiny-org/tiny-llama"
    cli = subprocess.run(
        [sys.executable, "-m", "pipeserve.launch.cli", "generate", "model=hf", "model.path=tiny-org/tiny-llama",
         "chat=false", "prompts=[t5 t6 t7]", "sampling.max_tokens=3", "engine.device=cpu", "engine.num_kv_blocks=64",
         f"hydra.run.dir={tmp_path / 'run'}"],
        env=dict(os.environ, HF_HOME=str(hf_home), HF_HUB_OFFLINE="1"), capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr[-2000:]


def test_what_is_a_hub_id(tmp_path, monkeypatch):
    assert hub.is_hub_id("Qwen/Qwen3-8B") and hub.is_hub_id("meta-llama/Llama-3.1-8B-Instruct")
    assert not hub.is_hub_id("model.gguf") and not hub.is_hub_id("/models/llama") and not hub.is_hub_id("a/b/c")
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not hub.is_hub_id("org/name")  # a folder of that name here wins
    assert hub.repo_id_of("/models/llama") is None


def test_only_the_files_a_model_needs_are_fetched():
    from huggingface_hub.utils import filter_repo_objects

    repo = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "model-00001-of-00004.safetensors", "model.safetensors.index.json", "chat_template.jinja",
            "pytorch_model-00001-of-00004.bin", "pytorch_model.bin.index.json", "original/consolidated.00.pth",
            "model.gguf", "README.md", "LICENSE", ".gitattributes", "onnx/model.onnx"]
    fetched = set(filter_repo_objects(repo, allow_patterns=hub.NEEDED_FILES))
    assert fetched == {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                       "model-00001-of-00004.safetensors", "model.safetensors.index.json", "chat_template.jinja"}


def test_revision_needs_a_hub_id():
    from pipeserve import LLM

    with pytest.raises(ValueError, match="revision='v1' applies to a hub id"):
        LLM(None, revision="v1")
