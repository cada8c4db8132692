"""One rank's forward of a micro-batch: a step's packed inputs (or a captured graph's padded
copy of them) through this rank's slice of the model."""

from __future__ import annotations

import torch

from pipeserve.runtime.model.llama import LlamaForCausalLM
from pipeserve.runtime.worker.batch import ModelInputs, StepInputs, to_tensors
from pipeserve.runtime.worker.cuda_graphs import CudaGraphRunner, GraphStep


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

    def prepare(self, step: StepInputs) -> GraphStep | ModelInputs:
        """Host-side inputs: a padded graph step when a captured bucket holds the step (decode
        or mixed, ``CudaGraphRunner.prepare``), else the packed tensors of an eager forward."""
        if self.cuda_graphs is not None and (g := self.cuda_graphs.prepare(step)) is not None:
            return g
        return to_tensors(step, block_size=self.block_size, device=self.device)

    def forward(self, inputs: GraphStep | ModelInputs, hidden_in: torch.Tensor | None = None,
                feed=None) -> torch.Tensor:
        """This rank's output [T, H] (a graph's output is a view its next replay rewrites).
        ``hidden_in``: the previous stage's output (not on the first stage); ``feed``: the fed
        decode tokens' patch of the input ids (first stage, token feedback)."""
        if isinstance(inputs, GraphStep):
            return self.cuda_graphs.replay(inputs, hidden_in, feed)
        if feed is not None:
            feed(inputs.input_ids)
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, hidden_states=hidden_in)

    @torch.inference_mode()
    def forward_logits(self, step: StepInputs) -> torch.Tensor:
        """Logits [N, V] (float32) of the last token of every sequence that samples (a model
        that holds every layer)."""
        return self.model.compute_logits(self._sampled_hidden(step))

    @torch.inference_mode()
    def forward_greedy(self, step: StepInputs) -> torch.Tensor:
        """[N] int64: the argmax of ``forward_logits``, taken as a worker takes it for a step whose
        rows all take their argmax (``LlamaForCausalLM.greedy_token_ids``: no full-vocabulary
        logits gathered)."""
        return self.model.greedy_token_ids(self._sampled_hidden(step))

    def _sampled_hidden(self, step: StepInputs) -> torch.Tensor:
        """The forward's output rows [N, H] of the sequences that sample."""
        inputs = self.prepare(step)
        return self.forward(inputs)[inputs.sample_indices]
