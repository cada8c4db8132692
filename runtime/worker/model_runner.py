"""Runs one micro-batch on the model: packed inputs in, sampled token ids out."""

from __future__ import annotations

import torch

from pipeserve.runtime.worker.batch import StepInputs, to_tensors
from pipeserve.runtime.worker.cuda_graphs import CudaGraphRunner
from pipeserve.runtime.model.llama import LlamaForCausalLM
from pipeserve.runtime.worker.sampler import Sampler, SamplerOutput
from pipeserve.scheduler.sampling_params import SamplingParams


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        *,
        kv_caches: list[torch.Tensor],
        block_size: int,
        device: torch.device,
        cuda_graphs: CudaGraphRunner | None = None,
    ) -> None:
        """``cuda_graphs``: captured forwards over these ``kv_caches`` (None = eager)."""
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.cuda_graphs = cuda_graphs
        self.sampler = Sampler()

    @torch.inference_mode()
    def forward_logits(self, step: StepInputs) -> torch.Tensor:
        """Logits [N, V] (float32) of the last token of every sequence that samples."""
        if self.cuda_graphs is not None and (g := self.cuda_graphs.prepare(step)) is not None:
            hidden = self.cuda_graphs.replay(g)  # [T, H], one row per token
            return self.model.compute_logits(hidden[g.sample_indices])
        inputs = to_tensors(step, block_size=self.block_size, device=self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        return self.model.compute_logits(hidden[inputs.sample_indices])

    @torch.inference_mode()
    def execute(
        self,
        step: StepInputs,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        *,
        num_output_tokens: list[int],
        eos_token_ids: tuple[int, ...],
    ) -> SamplerOutput:
        """`params`/`generators`/`num_output_tokens` are per sampling sequence, in batch order
        (the last two let the sampler hold EOS back until min_tokens)."""
        logits = self.forward_logits(step)
        assert logits.shape[0] == len(params) == len(generators)
        return self.sampler(
            logits, params, generators, num_output_tokens=num_output_tokens, eos_token_ids=eos_token_ids
        )
