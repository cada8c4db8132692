"""`pipeserve bench serve`: load an OpenAI-compatible HTTP server (pipeserve's or another) with
vLLM `bench serve`'s options, and print `pipeserve bench`'s latency table.

    pipeserve bench serve --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 4
    pipeserve bench serve --port 8000 --backend openai-chat --dataset-name sharegpt --max-concurrency 16

No Hydra and no engine here: the client is runtime/bench/http_client.py. ``--dataset-name random``
makes every prompt --random-input-len tokens and asks for --random-output-len; a trace's name
(sharegpt, arxiv, azure_code, azure_conv, or zipf) takes its lengths as configs/workload/<name>.yaml
does for `pipeserve bench` (lengths cut for CPU there). Arrivals: Poisson at --request-rate, or all
at once (inf).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import difflib
import json
import math
import os

from pipeserve.launch.flags import FlagError, Parser
from pipeserve.runtime.bench.http_client import BACKENDS, ClientConfig, format_result, run
from pipeserve.runtime.bench.workload import WorkloadConfig

DATASETS = ("random", "sharegpt", "arxiv", "azure_code", "azure_conv", "zipf")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="pipeserve bench serve", allow_abbrev=False,
               formatter_class=_Formatter,
               description="Streams a workload to an OpenAI-compatible server and measures TTFT, TPOT, TBT (ITL) "
                           "and end-to-end latency per request.")
    add = p.add_argument
    add("--backend", choices=sorted(BACKENDS), default="openai",
        help="openai: /v1/completions; openai-chat: /v1/chat/completions")
    add("--base-url", help="the server, e.g. http://127.0.0.1:8000 (default: http://HOST:PORT)")
    add("--host", default="127.0.0.1", help="the server's host, without --base-url")
    add("--port", type=int, default=8000, help="the server's port, without --base-url")
    add("--model", help="the model to name in requests (default: the first of the server's /v1/models)")
    add("--api-key", help="Bearer key (default: $OPENAI_API_KEY)")
    add("--tokenizer", help="the model's tokenizer (folder, .gguf or hub id) for prompts of random tokens "
                            "(default: random English words, about one token each)")
    add("--dataset-name", choices=DATASETS, default="random",
        help="random: fixed lengths; a trace: its lengths as configs/workload/<name>.yaml")
    add("--num-prompts", type=int, default=1000, help="requests in the run")
    add("--random-input-len", type=int, help="--dataset-name random: prompt tokens (default: 1024)")
    add("--random-output-len", type=int, help="--dataset-name random: output tokens (default: 128)")
    add("--request-rate", type=float, default=math.inf, help="Poisson arrivals in requests/s; inf = all at once")
    add("--max-concurrency", type=int, help="most requests in flight (default: no limit)")
    add("--seed", type=int, default=0, help="seeds lengths, arrivals and prompts")
    add("--ignore-eos", action="store_true", help="ask for every output token (ignore_eos)")
    add("--save-result", action="store_true", help="write the result JSON")
    add("--result-dir", default=".", help="where --save-result writes")
    add("--result-filename", help="the JSON's name (default: BACKEND-RATEqps-MODEL-TIME.json)")
    return p


def main(argv: list[str]) -> None:
    parser = build_parser()
    ns, extra = parser.parse_known_args(argv)
    if extra:
        raise FlagError(_unknown(extra[0], parser))
    client = ClientConfig(base_url=ns.base_url or f"http://{ns.host}:{ns.port}", backend=ns.backend, model=ns.model,
                          api_key=ns.api_key or os.environ.get("OPENAI_API_KEY"), max_concurrency=ns.max_concurrency, ignore_eos=ns.ignore_eos,
                          tokenizer=ns.tokenizer)
    result = asyncio.run(_run(client, workload_config(ns)))
    print(format_result(result))
    if ns.save_result:
        path = os.path.join(ns.result_dir, ns.result_filename or _file_name(result, ns))
        os.makedirs(ns.result_dir, exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"\nwrote {path}")


async def _run(client: ClientConfig, workload: WorkloadConfig) -> dict:
    import aiohttp

    try:
        return await run(client, workload)
    except aiohttp.ClientConnectionError as e:  # the server is not there: nothing was measured
        raise ValueError(f"cannot reach {client.base_url}: {e}") from None


def workload_config(ns: argparse.Namespace) -> WorkloadConfig:
    """The requests: `pipeserve bench`'s workload of that name at the client's rate and count."""
    arrival = {"arrival": "offline", "rate": None} if math.isinf(ns.request_rate) else \
        {"arrival": "poisson", "rate": ns.request_rate}
    common = {"num_requests": ns.num_prompts, "seed": ns.seed, **arrival}
    if ns.dataset_name == "random":
        prompt, output = ns.random_input_len or 1024, ns.random_output_len or 128
        return WorkloadConfig(name="random", source="uniform", min_prompt_len=prompt, max_prompt_len=prompt,
                              min_output_len=output, max_output_len=output, **common)
    if ns.random_input_len is not None or ns.random_output_len is not None:
        raise ValueError("--random-input-len and --random-output-len need --dataset-name random")
    return dataclasses.replace(_workload_file(ns.dataset_name), **common)


def _workload_file(name: str) -> WorkloadConfig:
    import yaml

    from pipeserve import configs

    with open(os.path.join(os.path.dirname(configs.__file__), "workload", f"{name}.yaml")) as f:
        return WorkloadConfig(**yaml.safe_load(f))


def _file_name(result: dict, ns: argparse.Namespace) -> str:
    rate = "inf" if math.isinf(ns.request_rate) else f"{ns.request_rate:g}"
    concurrency = f"-concurrency{ns.max_concurrency}" if ns.max_concurrency else ""
    when = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{ns.backend}-{rate}qps{concurrency}-{result['model'].rsplit('/', 1)[-1]}-{when}.json"


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default only where there is one (the help says what none means)."""

    def _get_help_string(self, action):
        return action.help if action.default is None or action.default is False else super()._get_help_string(action)


def _unknown(arg: str, parser: argparse.ArgumentParser) -> str:
    name = arg.split("=", 1)[0]
    if not name.startswith("-"):
        return f"unexpected argument {arg!r}"
    options = [o for a in parser._actions for o in a.option_strings]
    close = difflib.get_close_matches(name, options, n=1)
    return f"unknown flag {name}" + (f" (did you mean {close[0]}?)" if close else "")
