"""Sampler time per step, by sampling options and batch size.

    python -m tools.sampler_cost                              # vocabulary 49152, N = 1 8 64 256
    python -m tools.sampler_cost --batch-sizes 64 --repeats 50
    python -m tools.sampler_cost --flat                       # top-p's worst case
    python -m tools.sampler_cost --device cuda --vocab-size 128256   # Llama 3's vocabulary on a GPU

Times ``Sampler()(logits, params, generators)`` with the ids copied to the host, as a worker
calls it, and prints the median milliseconds per step of each option (rows) at each batch size
(columns). Seeded rows keep their generators across steps, as requests do.

The logits are synthetic but shaped like SmolLM2-135M's: a row's logit at rank r falls as
-s * ln(r) (s uniform in [1.2, 2.4] per row, plus noise), which gives top-p 0.9 at temperature 1
a nucleus of 4 / 11 / 350 tokens at the 10th / 50th / 90th percentile (the model: 1 / 12 / 250).
``--flat`` draws them normal with std 3 instead: nuclei of thousands, where top-p must sort.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from pipeserve.runtime.worker.sampler import Sampler, make_generator
from pipeserve.scheduler.sampling_params import SamplingParams

MIXED = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=40),
    SamplingParams(temperature=1.0, top_p=0.95),
    SamplingParams(temperature=1.2, min_p=0.1),
    SamplingParams(temperature=0.8, top_k=100, top_p=0.9, seed=7),
    SamplingParams(temperature=1.0, top_p=0.8, min_p=0.05, logprobs=3),
]
OPTIONS: dict[str, Callable[[int], SamplingParams]] = {
    "greedy": lambda i: SamplingParams(temperature=0.0),
    "temperature": lambda i: SamplingParams(temperature=1.0),
    "top-k 50": lambda i: SamplingParams(top_k=50),
    "top-p 0.9": lambda i: SamplingParams(top_p=0.9),
    "min-p 0.05": lambda i: SamplingParams(min_p=0.05),
    "mixed": lambda i: MIXED[i % len(MIXED)],
    "seeded top-p 0.9": lambda i: SamplingParams(top_p=0.9, seed=i),
    "logprobs 5": lambda i: SamplingParams(logprobs=5),
}
"""Row i's settings under each option (temperature 1 unless said)."""

SamplerFn = Callable[..., object]


def make_logits(num_rows: int, vocab_size: int, *, flat: bool, seed: int = 0) -> torch.Tensor:
    """[num_rows, vocab_size] float32 logits (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    if flat:
        return torch.randn(num_rows, vocab_size, generator=gen) * 3
    ranks = torch.rand(num_rows, vocab_size, generator=gen).argsort(dim=-1).add_(1).float()
    slope = torch.empty(num_rows, 1).uniform_(1.2, 2.4, generator=gen)
    noise = torch.randn(num_rows, vocab_size, generator=gen) * 0.3
    return noise.sub_(slope * ranks.log_())


def time_step(sampler: SamplerFn, logits: torch.Tensor, params: Sequence[SamplingParams],
              repeats: int) -> float:
    """Median milliseconds of one sampler call, after one warm-up call."""
    generators = [make_generator(p.seed, logits.device) for p in params]
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        sampler(logits, params, generators)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3


def cost_table(sampler: SamplerFn, batch_sizes: Sequence[int], vocab_size: int, *, repeats: int,
               flat: bool, device: str = "cpu") -> dict[str, list[float]]:
    """{option: [ms per step at each batch size]}, the logits on ``device`` (the time includes
    bringing the ids to the host, which waits for the device)."""
    logits = make_logits(max(batch_sizes), vocab_size, flat=flat).to(device)
    table: dict[str, list[float]] = {name: [] for name in OPTIONS}
    for num_rows in batch_sizes:
        rows = logits[:num_rows]
        for name, make in OPTIONS.items():
            params = [make(i) for i in range(num_rows)]
            table[name].append(time_step(sampler, rows, params, repeats))
    return table


def format_table(table: dict[str, list[float]], batch_sizes: Sequence[int]) -> str:
    width = max(map(len, table)) + 2
    lines = ["ms/step".ljust(width) + "".join(f"{f'N={n}':>10}" for n in batch_sizes)]
    for name, times in table.items():
        lines.append(name.ljust(width) + "".join(f"{t:>10.2f}" for t in times))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--vocab-size", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per cell")
    parser.add_argument("--flat", action="store_true", help="flat logits (top-p sorts)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--device", default="cpu", help="where the logits are (cpu, cuda)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    table = cost_table(Sampler(), args.batch_sizes, args.vocab_size, repeats=args.repeats,
                       flat=args.flat, device=args.device)
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"the CPU, {torch.get_num_threads()} threads"
    print(f"vocabulary {args.vocab_size}, float32 logits on {where}, "
          f"{'flat' if args.flat else 'LM-shaped'} logits, median of {args.repeats}")
    print(format_table(table, args.batch_sizes))


if __name__ == "__main__":
    main()
