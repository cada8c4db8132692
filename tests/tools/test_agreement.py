"""tools/agreement: its prompts, its comparison of two layouts' greedy outputs (against outputs
built by hand), and a run of one process against pp=2 on CPU (tiny model, float32: the same
tokens)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

import tools
from tools import agreement

pytestmark = pytest.mark.timeout(300)


def outputs(tokens: list[list[int]], logprobs: list[list[dict[int, float]]]) -> dict:
    """A layout's outputs as run_layout writes them (log-probability keys are strings in JSON)."""
    return {"tokens": tokens, "logprobs": [[{str(k): v for k, v in lp.items()} for lp in seq] for seq in logprobs]}


def test_prompts_are_distinct_fixed_and_can_carry_a_context():
    first = agreement.prompts(64)
    assert len(set(first)) == 64 and first == agreement.prompts(64)
    long = agreement.prompts(3, context_words=40)
    assert all(len(p.split()) > 40 and p.endswith(q) for p, q in zip(long, first))
    assert long[0].split()[:40] == long[1].split()[:40]  # the same passage before each
    with pytest.raises(ValueError, match="at most 64"):
        agreement.prompts(65)


def test_compare_counts_agreement_and_the_margin_where_outputs_diverge():
    base = outputs([[5, 6, 7], [1, 2], [3, 4, 9]],
                   [[{5: -0.1, 8: -2.0}, {6: -0.2, 9: -1.0}, {7: -0.3}],
                    [{1: -0.5}, {2: -0.6}],
                    [{3: -0.1}, {4: -0.4, 8: -0.9}, {9: -0.2}]])
    other = outputs([[5, 6, 7], [1, 2], [3, 8, 2]],
                    [[{5: -0.1, 8: -2.0}, {6: -0.2, 9: -1.0}, {7: -0.3}],
                     [{1: -0.5}, {2: -0.625}],  # same tokens, one log-probability differs
                     [{3: -0.125}, {8: -0.3, 4: -0.5}, {2: -0.1}]])
    r = agreement.compare(base, other)
    assert r["num_prompts"] == 3
    assert r["same_greedy_fraction"] == pytest.approx(2 / 3) and r["identical_fraction"] == pytest.approx(1 / 3)
    # The third prompt diverges at position 1: the base preferred 4 by -0.4 - (-0.9) = 0.5.
    assert r["divergence_margins"] == [pytest.approx(0.5)] and r["margins_that_are_lower_bounds"] == 0
    assert r["length_only_divergences"] == 0
    # Before the divergence only position 0 of the third prompt differs: |-0.1 - -0.125|.
    assert r["max_prefix_logprob_deviation"] == pytest.approx(0.025)


def test_compare_bounds_a_token_outside_the_top_k_and_counts_an_early_stop():
    base = outputs([[1, 2], [4, 5, 6]], [[{1: -0.1}, {2: -0.2, 3: -1.5}], [{4: -0.1}, {5: -0.1}, {6: -0.1}]])
    other = outputs([[1, 7], [4, 5]], [[{1: -0.1}, {7: -0.3}], [{4: -0.1}, {5: -0.1}]])
    r = agreement.compare(base, other)
    assert r["same_greedy_fraction"] == 0.0
    assert r["divergence_margins"] == [pytest.approx(1.3)] and r["margins_that_are_lower_bounds"] == 1
    assert r["length_only_divergences"] == 1


@pytest.fixture
def chat_model(tiny_model, tmp_path) -> str:
    """The tiny model with a plain chat template (the tool asks chat questions)."""
    folder = shutil.copytree(tiny_model, tmp_path / "model")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder)


def test_one_process_against_pp2_on_cpu(chat_model, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(Path(tools.__file__).parents[1])  # the children run `python -m tools.agreement`
    out = tmp_path / "agree.json"
    agreement.main(["--model", chat_model, "--layouts", "pp=2", "--num-prompts", "3", "--max-tokens", "4",
                    "--dtype", "float32", "--kernel-backend", "torch", "--workdir", str(tmp_path),
                    "--out", str(out)])
    report = json.loads(out.read_text())["agreement"]["pp=2"]
    assert report["num_prompts"] == 3 and report["same_greedy_fraction"] == 1.0
    assert math.isfinite(report["max_prefix_logprob_deviation"])
    assert "| pp=2 | 100% |" in capsys.readouterr().out
