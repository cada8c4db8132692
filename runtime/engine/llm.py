"""The offline API, with vLLM's names: `LLM(...).generate(prompts, sampling_params)`."""

from __future__ import annotations

from collections.abc import Sequence

from pipeserve.runtime.config import EngineConfig, ParallelConfig
from pipeserve.runtime.model import hub
from pipeserve.runtime.engine.llm_engine import LLMEngine
from pipeserve.runtime.engine.outputs import CompletionOutput, Logprob, RequestOutput, RequestOutputKind
from pipeserve.scheduler.sampling_params import SamplingParams, StructuredOutputsParams
from pipeserve.scheduler import SchedulerConfig
from pipeserve.scheduler.prefix_tree import group_by_prefix, schedule_order

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]

Prompt = str | list[int]
Conversation = list[dict[str, str]]


class LLM:
    """An engine in this process. `LLM()` serves the embedded SmolLM2-135M-Instruct."""

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "auto",
        quantization: str | None = None,
        load_format: str = "auto",
        device: str = "auto",
        max_num_batched_tokens: int = 512,
        max_num_seqs: int = 128,
        block_size: int = 16,
        max_model_len: int | None = None,
        num_kv_blocks: int | None = None,
        kv_cache_memory_gb: float = 1.0,
        gpu_memory_utilization: float = 0.90,
        scheduler_policy: str = "sarathi",
        seed: int = 0,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        num_microbatches_in_flight: int | None = None,
        token_feedback: bool | None = None,
        enable_prefix_caching: bool = False,
        prefix_grouping: bool = False,
        kernel_backend: str = "auto",
        deterministic: bool = False,
        reduction_splits: int = 0,
        revision: str | None = None,
    ) -> None:
        """`model`: a Hugging Face folder, a .gguf file, or a hub id (``org/name``, at
        `revision`; fetched into the Hugging Face cache, ``runtime/model/hub.py``); None: the
        embedded SmolLM2-135M-Instruct. With tensor_parallel_size × pipeline_parallel_size > 1
        the engine stays in this process and starts that many workers under torchrun; `close()`
        stops them. `prefix_grouping` (BatchLLM-style offline batches) turns prefix caching on
        too."""
        if revision is not None and (model is None or not hub.is_hub_id(model)):
            raise ValueError(f"revision={revision!r} applies to a hub id (org/name), not to model={model!r}")
        if model is not None and hub.is_hub_id(model):
            model = hub.snapshot(model, revision)  # once, here: every rank reads this snapshot
        scheduler = SchedulerConfig(
            policy=scheduler_policy,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            enable_prefix_caching=enable_prefix_caching or prefix_grouping,
            prefix_grouping=prefix_grouping,
        )
        self.engine = _make_engine(
            EngineConfig(
                model=model,
                dtype=dtype,
                quantization=quantization,
                load_format=load_format,
                device=device,
                block_size=block_size,
                num_kv_blocks=num_kv_blocks,
                kv_cache_memory_gb=kv_cache_memory_gb,
                gpu_memory_utilization=gpu_memory_utilization,
                max_model_len=max_model_len,
                seed=seed,
                kernel_backend=kernel_backend,
                deterministic=deterministic,
                reduction_splits=reduction_splits,
                scheduler=scheduler,
                parallel=ParallelConfig(
                    tp=tensor_parallel_size,
                    pp=pipeline_parallel_size,
                    num_microbatches_in_flight=num_microbatches_in_flight,
                    token_feedback=token_feedback,
                ),
            )
        )

    @classmethod
    def from_config(cls, config: EngineConfig, *, loaded=None, record_steps: bool = False) -> LLM:
        """An LLM from a full EngineConfig; `loaded` reuses a model already in memory;
        ``record_steps`` keeps the engine's record of every micro-batch (``step_records``)."""
        llm = cls.__new__(cls)
        llm.engine = _make_engine(config, loaded, record_steps)
        return llm

    @property
    def is_driver(self) -> bool:
        """False on the ranks other than global rank 0 under an outer torchrun: they only serve
        as workers (their `LLM(...)` returns once the engine has shut down) and `generate`
        returns []."""
        return self.engine is not None

    def close(self) -> None:
        """Stops the workers, if any (also done at interpreter exit)."""
        if self.engine is not None:
            self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get_tokenizer(self):
        return None if self.engine is None else self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        prefix_grouping: bool | None = None,
    ) -> list[RequestOutput]:
        """One output per prompt, in order. Every prompt is checked before any is queued.

        ``prefix_grouping`` (None: the scheduler config's ``prefix_grouping``) queues the batch
        BatchLLM-style: prompts sharing a prefix together, groups with more decode work first
        (``scheduler.prefix_tree``), so each shared prefix is computed once by the prefix
        cache and evicted once its group is done. Outputs still come in the given order.
        """
        if self.engine is None:
            return []
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        checked = [self.engine.validate(p, sp) for p, sp in zip(prompts, params)]
        order = range(len(prompts))
        if self._grouping(prefix_grouping):
            order = _prefix_order(checked, params, block_size=self.engine.config.block_size)
        ids: list[list[str]] = [[] for _ in prompts]
        for i in order:
            ids[i] = self._add(prompts[i], params[i])
        finished = self._run_to_completion(sum(len(g) for g in ids), use_tqdm)
        outputs = [_merge([finished[rid] for rid in g]) for g in ids]
        tokenizer = self.engine.tokenizer
        for out in outputs:
            for c in out.outputs:
                if c.logprobs is not None:
                    c.logprobs = [_as_vllm_logprobs(lp, tokenizer) for lp in c.logprobs]
                    c.cumulative_logprob = sum(lp[t] for t, lp in zip(c.token_ids, c.logprobs))
            if out.prompt_logprobs is not None:
                out.prompt_logprobs = [None if lp is None else _as_vllm_logprobs(lp, tokenizer)
                                       for lp in out.prompt_logprobs]
        return outputs

    def _grouping(self, requested: bool | None) -> bool:
        sched = self.engine.config.scheduler
        if requested is None:
            return sched.prefix_grouping
        if requested and not sched.enable_prefix_caching:
            raise ValueError("prefix_grouping needs enable_prefix_caching=True")
        return requested

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Applies the model's chat template (Jinja) to each conversation, then generates."""
        if self.engine is None:
            return []
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        prompts = [
            tok.apply_chat_template(c, add_generation_prompt=add_generation_prompt, tokenize=True)
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _add(self, prompt: Prompt, params: SamplingParams) -> list[str]:
        """Queues `params.n` sequences (seeds offset per sequence so they differ; the prompt's
        logprobs computed by the first only)."""
        ids = []
        for i in range(params.n):
            sp = params
            if params.n > 1 and params.seed is not None:
                sp = params.clone(seed=(params.seed + i) % 2**64)
            if i > 0 and params.prompt_logprobs is not None:
                sp = sp.clone(prompt_logprobs=None)
            rid = self.engine.new_request_id()
            # Only finished outputs are read: the engine need not build one per token.
            self.engine.add_request(rid, prompt, sp, output_kind=RequestOutputKind.FINAL_ONLY)
            ids.append(rid)
        return ids

    def _run_to_completion(self, total: int, use_tqdm: bool) -> dict[str, RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = _progress(total) if use_tqdm else None
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return finished


def _make_engine(config: EngineConfig, loaded=None, record_steps: bool = False):
    """An engine in this process (its workers: in this process for one device, else a torchrun
    it starts); or, under an outer torchrun with tp × pp > 1, on every rank but global rank 0,
    None once this rank has served as a worker until rank 0's engine shut down."""
    from pipeserve.runtime.engine import spmd

    if spmd.is_worker_rank(config):
        spmd.serve_as_worker(config)
        return None
    return LLMEngine(config, loaded=loaded, record_steps=record_steps)


def _prefix_order(checked, params: list[SamplingParams], *, block_size: int) -> list[int]:
    """Prompt indices in BatchLLM order; ``checked`` holds validate()'s (text, ids, max_tokens)."""
    prompt_ids = [ids for _, ids, _ in checked]
    decode_tokens = [max_tokens * sp.n for (_, _, max_tokens), sp in zip(checked, params)]
    return schedule_order(group_by_prefix(prompt_ids, decode_tokens, block_size=block_size))


def _as_vllm_logprobs(entry: dict[int, tuple[float, int]], tokenizer) -> dict[int, Logprob]:
    """One position's logprobs as vLLM's offline API gives them: a ``Logprob`` (with its rank
    and decoded text) per token."""
    return {t: Logprob(v, rank, tokenizer.token_text(t, skip_special_tokens=False))
            for t, (v, rank) in entry.items()}


def _merge(outputs: list[RequestOutput]) -> RequestOutput:
    """The n sequences of one prompt become one RequestOutput with n completions."""
    first = outputs[0]
    completions = []
    for i, o in enumerate(outputs):
        c = o.outputs[0]
        c.index = i
        completions.append(c)
    return RequestOutput(
        request_id=first.request_id,
        prompt=first.prompt,
        prompt_token_ids=first.prompt_token_ids,
        outputs=completions,
        finished=True,
        metrics=first.metrics,
        prompt_logprobs=first.prompt_logprobs,
    )


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    if not prompts:
        raise ValueError("no prompts given")
    return prompts


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return params


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req")
