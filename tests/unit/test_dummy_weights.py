"""Random benchmark weights (``load_format="dummy"``) are the same in every tp/pp layout: each
checkpoint tensor is drawn whole from a generator seeded by its name, and each rank slices it
as it would a checkpoint. Checked against the one-process model, parameter by parameter."""

from __future__ import annotations

import pytest
import torch
from helpers_model import write_tiny_checkpoint, write_tiny_model, write_word_level_tokenizer
from safetensors import safe_open

from pipeserve.parallel.context import ParallelContext
from pipeserve.runtime.model.loader import hf_weight_shapes, load_model

CPU = torch.device("cpu")


def _load(folder, **shard):
    return load_model(str(folder), dtype=torch.float32, device=CPU, load_format="dummy", **shard).model


def _params(model) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters(remove_duplicate=False))


def test_pipeline_stage_holds_the_same_layers(tmp_path):
    folder = write_tiny_model(tmp_path, num_hidden_layers=3)
    whole, stage = _params(_load(folder)), _params(_load(folder, start_layer=1))
    for name, p in stage.items():  # layers.0 of the stage is the model's layer 1
        parts = name.split(".")
        if parts[0] == "layers":
            parts[1] = str(int(parts[1]) + 1)
        assert torch.equal(p, whole[".".join(parts)]), name
    assert not torch.equal(whole["layers.0.mlp.down_proj.weight"], whole["layers.1.mlp.down_proj.weight"])


def test_tensor_parallel_shards_tile_the_whole_weights(tmp_path):
    """Two TP ranks' column- and row-parallel shards put back together equal the one-process
    weights (q|k|v rows per head, gate|up per part, o/down columns)."""
    folder = write_tiny_model(tmp_path)
    whole = _params(_load(folder))
    # Loading runs no collective: the group is never used (the tp=2 forward is tests/mp's).
    contexts = [ParallelContext(rank=r, world_size=2, tp_size=2, pp_size=1, tp_group=object()) for r in range(2)]
    ranks = [_params(_load(folder, parallel=ctx)) for ctx in contexts]
    for name in ("layers.0.mlp.down_proj.weight", "layers.1.self_attn.o_proj.weight"):
        assert torch.equal(torch.cat([r[name] for r in ranks], dim=1), whole[name]), name
    gate_up = whole["layers.0.mlp.gate_up_proj.weight"]  # [gate | up] rows
    half = gate_up.shape[0] // 2
    for part, rows in enumerate((gate_up[:half], gate_up[half:])):
        shards = [r["layers.0.mlp.gate_up_proj.weight"].chunk(2)[part] for r in ranks]
        assert torch.equal(torch.cat(shards), rows)
    assert torch.equal(torch.cat([r["embed_tokens.weight"] for r in ranks]), whole["embed_tokens.weight"])


def test_shapes_cover_the_checkpoint(tmp_path):
    """Every tensor the model expects has a shape, norms are 1-D."""
    folder = write_tiny_model(tmp_path)
    model = _load(folder)
    shapes = hf_weight_shapes(model.config)
    assert model.expected_weight_names() <= shapes.keys()
    assert shapes["model.norm.weight"] == (model.config.hidden_size,)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_moe_shapes_match_a_saved_checkpoint_and_expert_shards_tile(tmp_path, kind):
    """An MoE's dummy tensors are named and shaped as transformers saves them (router and every
    expert's projections), and two TP ranks' expert shares (each expert's gate and up rows, its
    down columns) put back together equal the one-process experts."""
    folder = write_tiny_checkpoint(tmp_path, kind)
    write_word_level_tokenizer(folder)
    with safe_open(folder / "model.safetensors", "pt") as f:
        saved = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    whole_model = _load(folder)
    assert hf_weight_shapes(whole_model.config) == saved
    whole = _params(whole_model)
    contexts = [ParallelContext(rank=r, world_size=2, tp_size=2, pp_size=1, tp_group=object()) for r in range(2)]
    ranks = [_params(_load(folder, parallel=ctx)) for ctx in contexts]
    w13 = whole["layers.1.mlp.w13"]  # [E, gate rows | up rows, H]
    inter = w13.shape[1] // 2
    for part in (0, 1):
        shards = [r["layers.1.mlp.w13"].chunk(2, dim=1)[part] for r in ranks]
        assert torch.equal(torch.cat(shards, dim=1), w13[:, part * inter : (part + 1) * inter])
    assert torch.equal(torch.cat([r["layers.1.mlp.w2"] for r in ranks], dim=2), whole["layers.1.mlp.w2"])
    assert all(torch.equal(r["layers.1.mlp.gate.weight"], whole["layers.1.mlp.gate.weight"]) for r in ranks)
