"""The host's time to launch one micro-batch, eagerly and as a CUDA graph replay, against the
device's time to run it.

    python -m tools.host_launch --tokenizer gpt2_tokenizer.json --num-layers 16 [--profile 30]
    python -m tools.host_launch --model MODEL_DIR_OR_GGUF                    # (CPU: torch ops)

A pipeline stage that never waits for its input (stage 0) starts each micro-batch as soon as
the device is free and then runs at the pace of its host's launches if launching is slower
than the device; bench runs show it (``pipeline_gaps``: spans ending right after the last
launch; ``result.json`` stages' ``host``). This times the pieces on one device, for a stage of
``--num-layers`` layers (dummy weights of ``--shape``) and three micro-batches:

- ``prepare``: ``to_tensors`` (packing the inputs, the host-to-device copies queued);
- ``launch``: the host's time in the model's forward call, with the device kept busy by a sleep
  queued first, so the host never waits for it unless something in the call synchronizes
  (then ``launch`` holds the sleep's rest and the row says so);
- ``device``: the forward's device time between events, queued whole before it runs.

On CUDA with the Triton kernels every case runs both ways: ``eager`` (the kernels launched one
by one) and ``graph`` (``CudaGraphRunner``: ``prepare`` pads the step to its bucket, ``launch``
copies it into the static buffers and replays; the device time includes the padding).

``--profile N`` then runs the first micro-batch's launches under cProfile (the device busy as
above) and prints the N functions with the most own time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from collections.abc import Sequence

import torch

from pipeserve.kernels import kernel_ops
from tools.bench_peers import SHAPES, load_dummy_model
from pipeserve.launch.profile import DeviceSleep, Profiler
from pipeserve.runtime.worker.batch import to_tensors
from pipeserve.runtime.worker.cuda_graphs import CudaGraphRunner, graphs_enabled
from pipeserve.runtime.worker.kv_cache import allocate_kv_cache
from pipeserve.runtime.model.loader import load_model
from pipeserve.runtime.worker.model_runner import ModelRunner

CASES = {  # name -> (cached prefix, new tokens) per sequence
    "480-token chunk @1536 + 32 decodes @2000": [(2000, 1)] * 32 + [(1536, 480)],
    "512-token chunk @0": [(0, 512)],
    "64 decodes @2000": [(2000, 1)] * 64,
}
_SLEEP_S = 0.2  # the device's head start per timed launch: longer than any launch here


def _args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokenizer", help="a tokenizer.json for a dummy model of --shape")
    src.add_argument("--model", help="a model folder or GGUF file (its own weights)")
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--num-layers", type=int, default=16, help="layers of the stage (dummy model)")
    p.add_argument("--kernel-backend", default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--profile", type=int, default=0, metavar="N", help="then the top N functions by own time")
    p.add_argument("--device", default=None, help="default: cuda if present, else cpu")
    args = p.parse_args(argv)
    if args.reps < 1 or args.num_layers < 1:
        p.error("--reps and --num-layers must be >= 1")
    return args


class Path:
    """How a micro-batch is prepared and launched: eagerly (``to_tensors``, then the forward
    call), or through ``graphs`` (its ``prepare``, then a graph replay)."""

    def __init__(self, runner: ModelRunner, graphs: CudaGraphRunner | None = None) -> None:
        self.runner, self.graphs = runner, graphs
        self.name = "eager" if graphs is None else "graph"

    def prepare(self, step):
        if self.graphs is not None:
            inputs = self.graphs.prepare(step)
            assert inputs is not None, "no captured bucket holds this micro-batch"
            return inputs
        return to_tensors(step, block_size=self.runner.block_size, device=self.runner.device)

    def launch(self, inputs) -> None:
        if self.graphs is not None:
            self.graphs.replay(inputs)
        else:
            self.runner.model(inputs.input_ids, inputs.positions, self.runner.kv_caches, inputs.meta)


def time_case(profiler: Profiler, step, *, reps: int, sleep: DeviceSleep, path: Path | None = None) -> dict:
    """Median prepare / launch / device milliseconds of ``reps`` forwards of ``step`` (eager
    unless ``path`` says otherwise)."""
    path = path or Path(profiler.runner)
    cuda = profiler.runner.device.type == "cuda"
    for _ in range(2):  # warm-up (compiles, allocator)
        path.launch(path.prepare(step))
    profiler.sync()
    prepare, launch, dev = [], [], []
    for _ in range(reps):
        sleep(_SLEEP_S)
        t0 = time.perf_counter()
        inputs = path.prepare(step)
        t1 = time.perf_counter()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        path.launch(inputs)
        if cuda:
            end.record()
        t2 = time.perf_counter()
        profiler.sync()
        prepare.append(t1 - t0)
        launch.append(t2 - t1)
        dev.append(start.elapsed_time(end) / 1e3 if cuda else t2 - t1)
    ms = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    row = {"prepare_ms": ms(prepare), "launch_ms": ms(launch), "device_ms": ms(dev)}
    # A launch that outlasted the device's head start waited for it: something synchronized.
    row["waited_for_device"] = cuda and row["prepare_ms"] + row["launch_ms"] > _SLEEP_S * 1e3 * 0.9
    return row


def profile_launches(profiler: Profiler, step, *, reps: int, sleep: DeviceSleep, top: int) -> str:
    """cProfile of ``reps`` launches of ``step`` (prepare + forward call), the device kept busy."""
    runner = profiler.runner
    device = runner.device
    prof = cProfile.Profile()
    for _ in range(reps):
        sleep(_SLEEP_S)
        prof.enable()
        inputs = to_tensors(step, block_size=runner.block_size, device=device)
        runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta)
        prof.disable()
        profiler.sync()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main(argv: Sequence[str] | None = None) -> None:
    args = _args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.model:
        loaded = load_model(args.model, dtype=dtype, device=device)
    else:
        loaded = load_dummy_model(args.tokenizer, shape=args.shape, num_layers=args.num_layers, dtype=dtype,
                                  device=device)
    loaded.model.set_ops(kernel_ops(args.kernel_backend, device))
    cfg = loaded.config
    blocks = max(sum(-(-(pre + q) // args.block_size) for pre, q in seqs) for seqs in CASES.values())
    kv = allocate_kv_cache(cfg, num_layers=cfg.num_hidden_layers, num_blocks=blocks,
                           block_size=args.block_size, dtype=dtype, device=device)
    runner = ModelRunner(loaded.model, kv_caches=kv, block_size=args.block_size, device=device)
    profiler = Profiler(runner, block_size=args.block_size, vocab_size=cfg.vocab_size, device=device)
    sleep = profiler.sleep
    paths = [Path(runner)]
    if graphs_enabled(max_batch=64, max_tokens=512, device=device, ops_name=loaded.model.ops.name):
        # The cases' buckets: 64 decodes, 512 tokens (and every smaller bucket, as a server has).
        graphs = CudaGraphRunner(loaded.model, kv, max_batch=64, max_tokens=512, max_seqs=64,
                                 block_size=args.block_size, max_model_len=4096, device=device)
        graphs.capture()
        paths.append(Path(runner, graphs))
    with torch.inference_mode():
        rows = [(name, path.name, time_case(profiler, profiler.step(seqs), reps=args.reps, sleep=sleep, path=path))
                for path in paths for name, seqs in CASES.items()]
        card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        print(f"host launch · {card} · {cfg.num_hidden_layers} layers of hidden {cfg.hidden_size} · kernels "
              f"{loaded.model.ops.name} · median of {args.reps}")
        print("| micro-batch | path | prepare ms | launch ms | device ms | launch ÷ device |\n|---|---|---|---|---|---|")
        for name, path, r in rows:
            note = " (waited for the device)" if r["waited_for_device"] else ""
            print(f"| {name} | {path} | {r['prepare_ms']:.2f} | {r['launch_ms']:.2f}{note} | {r['device_ms']:.2f} | "
                  f"{r['launch_ms'] / r['device_ms']:.2f} |")
        if args.profile:
            first = next(iter(CASES.values()))
            print(profile_launches(profiler, profiler.step(first), reps=args.reps, sleep=sleep, top=args.profile))


if __name__ == "__main__":
    main()
