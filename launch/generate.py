"""`pipeserve generate`: offline generation as a Hydra app (configs/generate.yaml)."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig, OmegaConf

from pipeserve.runtime.config import EngineConfig, ParallelConfig
from pipeserve.runtime.engine.llm import LLM
from pipeserve.scheduler.sampling_params import SamplingParams
from pipeserve.scheduler import SchedulerConfig


def engine_config(cfg: DictConfig) -> EngineConfig:
    """Hydra selects and overrides; the code receives validated dataclasses."""
    return EngineConfig(
        model=cfg.model.path,
        scheduler=SchedulerConfig(**OmegaConf.to_container(cfg.scheduler, resolve=True)),
        parallel=ParallelConfig(**OmegaConf.to_container(cfg.parallel, resolve=True)),
        **OmegaConf.to_container(cfg.engine, resolve=True),
    )


@hydra.main(version_base=None, config_path="../configs", config_name="generate")
def main(cfg: DictConfig) -> None:
    # With parallel.tp × parallel.pp > 1 this process is the engine and starts the torchrun
    # workers itself; they stop when the LLM closes.
    llm = LLM.from_config(engine_config(cfg))
    params = SamplingParams(**OmegaConf.to_container(cfg.sampling, resolve=True))
    prompts = list(cfg.prompts)
    if cfg.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    llm.close()
    for prompt, out in zip(prompts, outputs):
        print(f"### {prompt}\n{out.outputs[0].text}\n")


if __name__ == "__main__":
    main()
