"""vLLM's command-line flags for `pipeserve generate|serve|bench|sweep|profile`, as Hydra overrides.

    pipeserve serve org/name -tp 2 --max-num-seqs 64 --port 8080 scheduler=vllm

One table, ``FLAGS``, says which flag sets which config key(s) for which commands. ``to_overrides``
parses a command line with argparse and returns the Hydra overrides it stands for; Hydra then
composes them like any other, so a flag's value is checked exactly as its ``key=value`` is (the
same one-line errors). Hydra ``key=value`` overrides (and ``-m``/``--multirun``, ``--cfg``) may be
mixed with flags. A key set both by a flag and by an override is an error rather than a silent
choice of one. ``--config FILE.yaml`` (vLLM's) holds flag names and values, applied before the
command line's flags, so those win. A positional MODEL is ``model=hf model.path=MODEL`` (a
folder, a .gguf file or a hub id). Numeric flags accept Hydra's comma lists, which sweep under
``--multirun``.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

ENGINE = frozenset({"generate", "serve", "bench", "sweep", "profile"})
BENCH = frozenset({"bench", "sweep"})
SERVE = frozenset({"serve"})
GENERATE = frozenset({"generate"})


class FlagError(ValueError):
    """A command-line mistake; the CLI prints it as one line and exits 2."""


@dataclass(frozen=True, slots=True)
class Flag:
    names: tuple[str, ...]
    """Option strings, the long vLLM name first."""
    keys: tuple[str, ...]
    """The config keys it sets (``model`` is a config group: ``model=hf``)."""
    help: str
    commands: frozenset[str]
    kind: str = "str"
    """int / float (checked; a comma list passes for sweeps), word (passed as given), str
    (quoted: taken as a string whatever it looks like), bool (``--x``/``--no-x``), switch (no
    value), list (a JSON list or one value), append (repeatable)."""
    render: Callable[[object], tuple[str, ...]] | None = None
    """The flag's value -> one override value per key; None = the value, formatted by kind, for
    every key."""
    default: str | None = None
    """--help's default where the config's value would mislead; None = read from the config."""

    @property
    def dest(self) -> str:
        return self.names[0].lstrip("-").replace("-", "_")


def _model(path: str) -> tuple[str, ...]:
    return "hf", _quoted(path)


def _request_rate(rate: str) -> tuple[str, ...]:
    """inf: every request at t=0; a rate (or a comma list of rates, a sweep): Poisson arrivals."""
    return ("null", "offline") if "," not in rate and math.isinf(float(rate)) else (rate, "poisson")


FLAGS: tuple[Flag, ...] = (
    # the model and the engine: every command that runs one
    Flag(("--model",), ("model", "model.path"), "model: a Hugging Face folder, a .gguf file or a hub id org/name "
         "(also the positional MODEL)", ENGINE, render=_model, default="the embedded SmolLM2-135M-Instruct GGUF"),
    Flag(("--revision",), ("model.revision",), "a hub id's branch, tag or commit (with MODEL)", ENGINE,
         default="main"),
    Flag(("--tensor-parallel-size", "-tp"), ("parallel.tp",), "tensor-parallel ranks per pipeline stage", ENGINE,
         "int"),
    Flag(("--pipeline-parallel-size", "-pp"), ("parallel.pp",), "pipeline stages", ENGINE, "int"),
    Flag(("--max-model-len",), ("engine.max_model_len",), "longest prompt + output (null = the model's)",
         ENGINE, "int"),
    Flag(("--max-num-seqs",), ("scheduler.max_num_seqs",), "most sequences in one micro-batch", ENGINE, "int"),
    Flag(("--max-num-batched-tokens",), ("scheduler.max_num_batched_tokens",), "token budget of one micro-batch",
         ENGINE, "int"),
    Flag(("--gpu-memory-utilization",), ("engine.gpu_memory_utilization",),
         "fraction of the GPU the process may use (weights + activations + KV)", ENGINE, "float"),
    Flag(("--dtype",), ("engine.dtype",), "auto, float32, bfloat16 or float16 (auto: bfloat16 on CUDA, float32 on CPU)",
         ENGINE, "word"),
    Flag(("--quantization", "-q"), ("engine.quantization",),
         "fp8: the decoder's projections in FP8, quantized at load (null: as the checkpoint stores them)", ENGINE,
         "word"),
    Flag(("--enable-prefix-caching",), ("scheduler.enable_prefix_caching",), "automatic prefix caching", ENGINE,
         "bool"),
    Flag(("--enforce-eager",), ("engine.cuda_graph_max_batch", "engine.cuda_graph_max_tokens"),
         "never replay CUDA graphs (sets both keys to 0)", ENGINE, "switch", render=lambda _: ("0", "0")),
    Flag(("--block-size",), ("engine.block_size",), "tokens per KV-cache block", ENGINE, "int"),
    Flag(("--num-gpu-blocks-override",), ("engine.num_kv_blocks",), "KV blocks in the pool (null = sized from memory)",
         ENGINE, "int"),
    Flag(("--load-format",), ("engine.load_format",), "auto (read the weights) or dummy (random weights)", ENGINE,
         "word"),
    Flag(("--device",), ("engine.device",), "cpu, cuda or cuda:N (auto: cuda when available)", ENGINE, "word"),
    Flag(("--seed",), ("engine.seed",), "seed of the engine's generator", ENGINE - BENCH, "int"),
    # serve
    Flag(("--served-model-name",), ("server.served_model_name",), "the model name clients use (null = the "
         "checkpoint's name)", SERVE),
    Flag(("--host",), ("server.host",), "interface to listen on", SERVE),
    Flag(("--port",), ("server.port",), "TCP port (0 = any free one; the ready line says which)", SERVE, "int"),
    Flag(("--api-key",), ("server.api_key",), "Bearer key every route but /health wants", SERVE,
         default="$PIPESERVE_API_KEY or none"),
    Flag(("--api-key-file",), ("server.api_key_file",), "a file whose first line is the API key (kept out of ps)",
         SERVE),
    Flag(("--chat-template",), ("server.chat_template",), "chat template (a file or the template itself) instead of "
         "the model's", SERVE),
    Flag(("--ssl-keyfile",), ("server.ssl_keyfile",), "TLS private key file (HTTPS)", SERVE),
    Flag(("--ssl-certfile",), ("server.ssl_certfile",), "TLS certificate file (HTTPS)", SERVE),
    Flag(("--allowed-origins",), ("server.allowed_origins",), "CORS origins, a JSON list", SERVE, "list"),
    Flag(("--allowed-methods",), ("server.allowed_methods",), "CORS methods, a JSON list", SERVE, "list"),
    Flag(("--allowed-headers",), ("server.allowed_headers",), "CORS headers, a JSON list", SERVE, "list"),
    Flag(("--allow-credentials",), ("server.allow_credentials",), "CORS: allow credentials", SERVE, "switch",
         render=lambda _: ("true",)),
    Flag(("--uvicorn-log-level",), ("server.log_level",), "uvicorn's log level", SERVE, "word"),
    Flag(("--tool-call-parser",), ("server.tool_call_parser",), "how tool_choice \"auto\" reads calls: hermes or "
         "llama3_json", SERVE, "word"),
    Flag(("--enable-auto-tool-choice",), ("server.enable_auto_tool_choice",), "serve tool_choice \"auto\" (needs "
         "--tool-call-parser)", SERVE, "switch", render=lambda _: ("true",)),
    # generate
    Flag(("--max-tokens",), ("sampling.max_tokens",), "tokens to generate per prompt", GENERATE, "int"),
    Flag(("--temperature",), ("sampling.temperature",), "sampling temperature (0 = greedy)", GENERATE, "float"),
    Flag(("--top-p",), ("sampling.top_p",), "nucleus sampling mass", GENERATE, "float"),
    Flag(("--top-k",), ("sampling.top_k",), "sample among the k likeliest tokens (0 = all)", GENERATE, "int"),
    Flag(("--prompt",), ("prompts",), "a prompt (repeat the flag for several); replaces the default prompts",
         GENERATE, "append", render=lambda ps: ("[" + ",".join(_quoted(p) for p in ps) + "]",)),
    Flag(("--chat",), ("chat",), "apply the model's chat template to each prompt", GENERATE, "bool"),
    # bench (vLLM bench's names)
    Flag(("--dataset-name",), ("workload",), "a workload of configs/workload/ (random = uniform)", BENCH, "word",
         render=lambda name: ("uniform" if name == "random" else name,)),
    Flag(("--num-prompts",), ("workload.num_requests",), "requests in the run", BENCH, "int"),
    Flag(("--request-rate",), ("workload.rate", "workload.arrival"), "Poisson arrival rate in requests/s "
         "(inf = all at t=0: arrival offline)", BENCH, "float", render=_request_rate),
    Flag(("--random-input-len",), ("workload.min_prompt_len", "workload.max_prompt_len"),
         "--dataset-name random: every prompt's tokens", BENCH, "int", default="configs/workload/uniform.yaml's"),
    Flag(("--random-output-len",), ("workload.min_output_len", "workload.max_output_len"),
         "--dataset-name random: every output's tokens", BENCH, "int", default="configs/workload/uniform.yaml's"),
    Flag(("--seed",), ("workload.seed", "engine.seed"), "seeds the workload (lengths, arrivals, prompts) and the "
         "engine", BENCH, "int"),
    Flag(("--result-dir",), ("hydra.run.dir",), "the run folder (result.json, trace.json, plots)", BENCH - {"sweep"},
         default="runs/bench/<time>"),
)

REFUSED = {
    "--trust-remote-code": "pipeserve runs its own implementation of each supported architecture (docs/models.md) "
                           "and never runs a checkpoint's code",
}
# Hydra's own flags, handed to Hydra as given.
HYDRA_SWITCHES = ("--multirun", "-m", "--resolve", "--hydra-help")
HYDRA_VALUES = ("--cfg", "-c")


def flags_for(command: str) -> list[Flag]:
    return [f for f in FLAGS if command in f.commands]


def to_overrides(command: str, argv: list[str], *, defaults: dict | None = None) -> list[str]:
    """``argv`` (flags, a MODEL, Hydra overrides) as Hydra's command line: Hydra's own flags, then
    the flags' overrides, then the user's overrides in their order. FlagError for an unknown
    flag, a bad value, or a key set twice."""
    argv = _with_config_file(command, argv)
    parser = build_parser(command, defaults)
    ns, extra = parser.parse_known_intermixed_args(argv)
    for arg in extra:
        if arg.startswith("-"):
            raise FlagError(unknown_flag(command, arg.split("=", 1)[0]))
        raise FlagError(f"unexpected argument {arg!r}")
    model, overrides = _split_positionals(ns.args)
    if model is not None:
        if ns.model is not None:
            raise FlagError(f"give the model once: {model!r} or --model {ns.model!r}")
        ns.model = model
    _check_requirements(ns, overrides)
    flagged = _flag_overrides(command, ns)
    _check_conflicts(flagged, overrides)
    return [*ns.hydra, *(f"{k}={v}" for k, v in flagged), *overrides]


def build_parser(command: str, defaults: dict | None = None) -> argparse.ArgumentParser:
    """The command's flags; ``defaults`` (config key -> value, for --help) shown beside each."""
    parser = Parser(prog=f"pipeserve {command}", allow_abbrev=False, formatter_class=_Formatter,
                    usage=f"pipeserve {command} [MODEL] [flags] [key=value ...]",
                    description=f"Flags set keys of configs/{_config_name(command)}.yaml; Hydra key=value overrides"
                                " are accepted too, mixed with flags (a key set by both is an error).",
                    epilog=f"refused: {', '.join(f'{n} ({why})' for n, why in REFUSED.items())}. "
                           "Hydra: -m/--multirun, --cfg job|hydra|all, --resolve, --hydra-help.")
    parser.add_argument("args", nargs="*", metavar="MODEL | key=value",
                        help="a model (folder, .gguf or hub id: model=hf model.path=MODEL) and Hydra overrides")
    parser.add_argument("--config", metavar="FILE.yaml", help="flag names -> values, applied before the command "
                        "line's flags (default: none)")
    for flag in flags_for(command):
        _add(parser, flag, defaults)
    parser.set_defaults(hydra=[])
    for name in HYDRA_SWITCHES:
        parser.add_argument(name, nargs=0, action=_Hydra, help=argparse.SUPPRESS)
    for name in HYDRA_VALUES:
        parser.add_argument(name, nargs=1, action=_Hydra, help=argparse.SUPPRESS)
    for name in REFUSED:
        parser.add_argument(name, nargs=0, action=_Refused, help=argparse.SUPPRESS)
    return parser


def _add(parser: argparse.ArgumentParser, flag: Flag, defaults: dict | None) -> None:
    shown = flag.default if flag.default is not None else _default_of(flag, defaults)
    keys = ", ".join(flag.keys)
    text = f"{flag.help} [{keys}]" + (f" (default: {shown})" if defaults is not None else "")
    kw: dict = {"dest": flag.dest, "help": text.replace("%", "%%"), "default": None}
    if flag.kind == "bool":
        kw["action"] = argparse.BooleanOptionalAction
    elif flag.kind == "switch":
        kw["action"] = "store_true"
    elif flag.kind == "append":
        kw["action"] = "append"
    else:
        kw["type"] = {"int": _numbers(int), "float": _numbers(float), "list": _json_list}.get(flag.kind, str)
        kw["metavar"] = {"int": "N", "float": "X", "list": "JSON"}.get(flag.kind, "VALUE")
    parser.add_argument(*flag.names, **kw)


def _default_of(flag: Flag, defaults: dict | None) -> str:
    if not defaults:
        return ""
    values = [_yaml(defaults.get(key, "unset")) for key in flag.keys]
    if flag.kind == "switch":
        return "off (" + ", ".join(f"{k}={v}" for k, v in zip(flag.keys, values)) + ")"
    return ", ".join(str(v) for v in values)


def _yaml(value) -> str:
    """A default as YAML writes it (true, null), not as Python does."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return str(value)


def _flag_overrides(command: str, ns: argparse.Namespace) -> list[tuple[str, str]]:
    out = []
    for flag in flags_for(command):
        value = getattr(ns, flag.dest)
        if value is None or value is False and flag.kind == "switch":
            continue
        values = flag.render(value) if flag.render else (_format(flag.kind, value),) * len(flag.keys)
        out += list(zip(flag.keys, values, strict=True))
    return out


def _format(kind: str, value) -> str:
    if kind == "bool":
        return "true" if value else "false"
    if kind == "str":
        return _quoted(value)
    if kind == "list":
        return "[" + ",".join(_quoted(v) for v in value) + "]"
    return str(value)  # int, float (as typed, comma lists included), word


def _split_positionals(args: list[str]) -> tuple[str | None, list[str]]:
    """(the MODEL, the Hydra overrides): an argument holding "=" (or deleting a key, ``~key``)
    is an override; one other argument may be the model."""
    model, overrides = None, []
    for arg in args:
        if "=" in arg or arg.startswith("~"):
            overrides.append(arg)
        elif model is None:
            model = arg
        else:
            raise FlagError(f"unexpected argument {arg!r} (the model is {model!r}; Hydra overrides are key=value)")
    return model, overrides


def _check_requirements(ns: argparse.Namespace, overrides: list[str]) -> None:
    chose_model = ns.model is not None or any(_key(o) == "model" for o in overrides)
    if getattr(ns, "revision", None) is not None and not chose_model:
        raise FlagError("--revision needs a MODEL (a hub id org/name)")
    for name in ("random_input_len", "random_output_len"):
        if getattr(ns, name, None) is not None and getattr(ns, "dataset_name", None) != "random":
            raise FlagError(f"--{name.replace('_', '-')} needs --dataset-name random")


def _check_conflicts(flagged: list[tuple[str, str]], overrides: list[str]) -> None:
    by_key = dict(flagged)
    for override in overrides:
        key, _, value = override.partition("=")
        key = _key(override)
        if key in by_key and by_key[key] != value:
            flag = next(f.names[0] for f in FLAGS if key in f.keys)
            raise FlagError(f"{key} is set both by {flag} and by {override!r}; give one")


def _key(override: str) -> str:
    return override.partition("=")[0].lstrip("+~")


def unknown_flag(command: str, name: str) -> str:
    """What to say of a flag this command lacks: the nearest it has, or the command it belongs to."""
    others = sorted({c for f in FLAGS if name in f.names for c in f.commands})
    if others:
        return f"{name} is not a flag of pipeserve {command} (it is one of pipeserve {', '.join(others)})"
    ours = [n for f in flags_for(command) for n in f.names if n.startswith("--")] + ["--config", "--help"]
    close = difflib.get_close_matches(name, ours, n=1)
    if close:
        return f"unknown flag {name} (did you mean {close[0]}?)"
    return f"unknown flag {name} (pipeserve {command} --help lists them; Hydra overrides are key=value)"


# ---- --config FILE.yaml --------------------------------------------------------------------------


def _with_config_file(command: str, argv: list[str]) -> list[str]:
    """``argv`` with ``--config FILE`` replaced by the file's flags, placed first (so the command
    line's own flags, parsed after, win)."""
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name != "--config":
            continue
        if not eq:
            if i + 1 >= len(argv):
                raise FlagError("--config needs a YAML file")
            value, rest = argv[i + 1], argv[:i] + argv[i + 2:]
        else:
            rest = argv[:i] + argv[i + 1:]
        return [*config_file_args(command, value), *_with_config_file(command, rest)]
    return argv


def config_file_args(command: str, path: str) -> list[str]:
    """vLLM's config file: a YAML mapping of flag names (with - or _) to values, as flags."""
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except OSError as e:
        raise FlagError(f"--config {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise FlagError(f"--config {path}: not YAML ({' '.join(str(e).split())})") from None
    if not isinstance(data, dict):
        raise FlagError(f"--config {path}: expected a mapping of flag names to values")
    kinds = {n: f.kind for f in flags_for(command) for n in f.names if n.startswith("--")}
    args: list[str] = []
    for key, value in data.items():
        name = "--" + str(key).replace("_", "-")
        if name not in kinds:
            raise FlagError(f"--config {path}: " + unknown_flag(command, name))
        kind = kinds[name]
        if kind in ("bool", "switch"):
            if not isinstance(value, bool):
                raise FlagError(f"--config {path}: {key} must be true or false, got {value!r}")
            args += [name] if value else ([f"--no-{name[2:]}"] if kind == "bool" else [])
        elif kind == "append":
            args += [a for v in (value if isinstance(value, list) else [value]) for a in (name, str(v))]
        elif kind == "list":
            args += [name, json.dumps(value if isinstance(value, list) else [value])]
        else:
            args.append(f"{name}={value}")
    return args


# ---- argparse pieces -----------------------------------------------------------------------------


class Parser(argparse.ArgumentParser):
    """argparse that raises FlagError (the CLI's one-line error) instead of printing usage."""

    def error(self, message: str):
        raise FlagError(message)


class _Formatter(argparse.HelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=34, width=110)


class _Hydra(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        namespace.hydra = [*namespace.hydra, option_string, *values]


class _Refused(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        raise FlagError(f"{option_string} is not supported: {REFUSED[option_string]}")


def _numbers(cls) -> Callable[[str], str]:
    """A checker of ``cls`` values that keeps the text: one number, ``null``, or a comma list (a
    sweep under --multirun)."""

    def check(text: str) -> str:
        for part in text.split(","):
            if part.strip() == "null":
                continue
            try:
                cls(part)
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected {'an integer' if cls is int else 'a number'}, "
                                                 f"got {text!r}") from None
        return text

    check.__name__ = cls.__name__
    return check


def _json_list(text: str) -> list[str]:
    """vLLM's JSON list (``'["*"]'``), or one bare value."""
    if not text.startswith("["):
        return [text]
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}") from None
    if not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


def _config_name(command: str) -> str:
    return "bench" if command == "sweep" else command


def _quoted(value: str) -> str:
    """A Hydra quoted string (taken as a string whatever it looks like): backslashes before a
    quote or at the end are doubled, then quotes escaped (Hydra's override grammar)."""
    value = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, value)
    return "'" + value.replace("'", "\\'") + "'"
