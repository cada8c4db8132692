"""Slurm: sbatch templates (this folder's *.sbatch) and the glue Hydra sweeps need there.

| template | what it runs |
|---|---|
| `generate.sbatch` | `pipeserve generate` on one node: srun → torchrun (tp × pp workers, SPMD) |
| `generate_multinode.sbatch` | the same over several nodes: one torchrun per node, c10d rendezvous on the first |
| `bench.sbatch` | `pipeserve bench` on one node (the bench process starts its torchrun workers) |
| `bench_multinode.sbatch` | `pipeserve bench` over several nodes: one torchrun per node, rank 0 runs the bench |
| `sweep.sbatch` | `pipeserve bench --multirun` in one allocation: points one after another, one table |
| `serve.sbatch` | `pipeserve serve` on one node, the HTTP server on the node's address |
| `serve_multinode.sbatch` | `pipeserve serve` over several nodes: rank 0 runs the HTTP server on the first node |

Sweeps with one Slurm job per point: `+launcher=slurm` (configs/launcher/, Hydra's submitit
launcher). See the README section "Slurm and clusters".
"""

from pathlib import Path

TEMPLATES = Path(__file__).parent  # copy a template from here, then edit it

