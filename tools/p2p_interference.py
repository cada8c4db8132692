"""Does a point-to-point transfer that is still waiting for its peer slow a stage's compute?

    torchrun --standalone --nproc-per-node 2 -m tools.p2p_interference              # NCCL, 2 GPUs
    torchrun --standalone --nproc-per-node 2 -m tools.p2p_interference --hidden 64   # gloo on CPU

In a pipeline, stage 0's send of micro-batch j's hidden states waits until stage 1 posts the
matching receive (after it finishes j - 1), and with token feedback stage 0 posts the receive of
j's sampled ids early, which waits until the last stage samples j. On NCCL both are kernels that
sit on the device while stage 0 computes j + 1. This probe measures what that costs: rank 0
times ``--reps`` repetitions of a decoder layer's matrix products at ``--tokens`` tokens
(Llama-3-8B's shapes by default: QKV, O, gate/up, down; ``--layers`` of them per repetition) on
its compute stream, with

    idle   nothing else posted;
    recv   an irecv from rank 1 posted first, matched only after the timing;
    send   an isend of a [tokens, hidden] tensor to rank 1 posted first, matched after the timing;

and prints the median milliseconds per repetition of each, its slowdown against ``idle``, and
in how many rounds the transfer was still pending when the timing ended (NCCL may complete a
send that fits its buffers before the peer receives; then ``send`` timed nothing pending).
Timing uses events on the compute stream only: a device-wide synchronize would wait for the
transfer that nobody has matched yet. Rank 1 matches each transfer once rank 0 says, through
torchrun's key-value store, that its timing is done (no second process group: a gloo group's
connections may hang on a host whose own name does not resolve to a reachable address).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from pipeserve.parallel.context import nccl_options

MODES = ("idle", "recv", "send")


def _args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=512, help="rows of every product (a micro-batch's tokens)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=None, help="MLP width (default 3.5 × hidden)")
    p.add_argument("--layers", type=int, default=16, help="layers per timed repetition (a stage's)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3, help="the three modes are timed this many times, interleaved")
    p.add_argument("--max-ctas", type=int, default=None,
                   help="NCCL: transfers on a group whose kernels hold at most this many CTAs (as the token-"
                        "feedback group's, parallel.feedback_max_ctas); default: the default group")
    args = p.parse_args(argv)
    args.intermediate = args.intermediate or int(args.hidden * 3.5)
    for name in ("tokens", "hidden", "intermediate", "layers", "reps", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.max_ctas is not None and args.max_ctas < 1:
        p.error("--max-ctas must be >= 1")
    return args


class Layer:
    """The matrix products of one decoder layer (GQA with 8 KV heads of 128, or a quarter of
    the width on small probes), in the probe's dtype."""

    def __init__(self, hidden: int, intermediate: int, device: torch.device, dtype: torch.dtype) -> None:
        kv = min(1024, hidden // 4)
        g = torch.Generator(device="cpu").manual_seed(0)
        w = lambda *shape: (torch.randn(*shape, generator=g) * 0.02).to(device, dtype)  # noqa: E731
        self.qkv, self.o = w(hidden, hidden + 2 * kv), w(hidden, hidden)
        self.gate_up, self.down = w(hidden, 2 * intermediate), w(intermediate, hidden)
        self.hidden, self.intermediate = hidden, intermediate

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        q = (x @ self.qkv)[:, : self.hidden]
        x = x + q @ self.o
        gu = x @ self.gate_up
        return x + (torch.nn.functional.silu(gu[:, : self.intermediate]) * gu[:, self.intermediate:]) @ self.down


def _time(fn, device: torch.device) -> float:
    """Seconds of ``fn``'s work on the current stream (events on CUDA, the host clock on CPU)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()  # this stream only
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(args: argparse.Namespace, rank: int, device: torch.device, store) -> tuple[dict, dict] | None:
    """Rank 0: per mode, seconds per repetition, and the rounds its transfer was still pending
    after the timing; rank 1: None. ``store``: a key-value store both ranks reach (torchrun's)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    message = torch.zeros(args.tokens, args.hidden, dtype=dtype, device=device)
    group = None
    if args.max_ctas is not None:
        group = dist.new_group([0, 1], pg_options=nccl_options(max_ctas=args.max_ctas))
    send = functools.partial(dist.send, group=group)
    recv = functools.partial(dist.recv, group=group)
    # One exchange each way first: NCCL connects a direction on its first transfer, which blocks
    # the host until the peer joins, and the peer here joins only after the timing.
    for src in (0, 1):
        if rank == src:
            send(message, dst=1 - src)
        else:
            recv(message, src=src)
    timed = (f"p2p_interference/{r}/{mode}" for r in range(args.rounds) for mode in MODES)
    if rank != 0:
        for _ in range(args.rounds):
            for mode in MODES:
                store.wait([next(timed)])  # rank 0 has timed `mode` with its transfer pending
                if mode == "recv":
                    send(message, dst=0)
                elif mode == "send":
                    recv(message, src=0)
        if device.type == "cuda":
            torch.cuda.synchronize()  # (every transfer is matched: nothing to wait for)
        return None
    layer = Layer(args.hidden, args.intermediate, device, dtype)
    x = torch.randn(args.tokens, args.hidden, device=device).to(dtype)

    def stage() -> None:
        h = x
        for _ in range(args.layers):
            h = layer(h)

    for _ in range(3):  # warm-up: kernels chosen, clocks up
        _time(stage, device)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    pending = {m: 0 for m in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            work = None
            if mode == "recv":
                work = dist.irecv(torch.empty_like(message), src=1, group=group)
            elif mode == "send":
                work = dist.isend(message, dst=1, group=group)
            times[mode] += [_time(stage, device) for _ in range(args.reps)]
            pending[mode] += work is not None and not work.is_completed()
            store.set(next(timed), "1")
            if work is not None:
                work.wait()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return times, pending


def format_table(times: dict[str, list[float]], pending: dict[str, int], args: argparse.Namespace,
                 device_name: str) -> str:
    idle = statistics.median(times["idle"])
    nccl = "gloo" not in device_name
    ctas = f" · transfers on a group of at most {args.max_ctas} CTAs" if args.max_ctas and nccl else ""
    lines = [f"p2p interference · {device_name} · {args.layers} layers of hidden {args.hidden},"
             f" MLP {args.intermediate}, {args.tokens} tokens · {len(times['idle'])} repetitions per mode{ctas}",
             "| pending on rank 0 | median ms per repetition | against idle | still pending after the timing |",
             "|---|---|---|---|"]
    for mode in MODES:
        m = statistics.median(times[mode])
        still = "-" if mode == "idle" else f"{pending[mode]} of {args.rounds} rounds"
        lines.append(f"| {mode} | {m * 1e3:.3f} | {m / idle - 1:+.1%} | {still} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    args = _args(argv)
    if "RANK" not in os.environ:
        raise SystemExit("run under torchrun with 2 processes (see the module's docstring)")
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=120))
    try:
        if dist.get_world_size() != 2:
            raise SystemExit(f"needs exactly 2 processes, got {dist.get_world_size()}")
        store = dist.distributed_c10d._get_default_store()
        out = run(args, dist.get_rank(), device, store)
        if out is not None:
            name = torch.cuda.get_device_name(device) if cuda else "cpu (gloo)"
            print(format_table(*out, args, name), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
