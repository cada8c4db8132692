"""The engine's configuration: what the user chose. Values found at run time live in EngineState."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from pipeserve.kernels import BACKENDS as KERNEL_BACKENDS
from pipeserve.scheduler import SchedulerConfig

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel ranks per pipeline stage."""
    pp: int = 1
    """Pipeline stages."""
    num_microbatches_in_flight: int | None = None
    """Micro-batches in the pipeline at once; None = pp, or pp + 1 with token feedback."""
    token_feedback: bool | None = None
    """The device hands each sampled token to the next micro-batch that decodes it, so a
    request's next decode is planned before its result reaches the engine
    (``parallel/feedback.py``). pp > 1: the last stage sends it to the first, and the stages do
    not wait for the engine's round trip; at pp=2 on 2 × H200 it took sarathi's bubbles while
    loaded from 17.6% / 23.4% to 12.3% / 14.7% per stage, and orca's from 56% to 30–40%. pp=1
    on a GPU: the engine plans and submits micro-batch N + 1 while the device computes N, which
    then takes N's ids from its own memory (the host's scheduling, input copies and launches
    overlap the device instead of following it). A request still decodes at most once per
    ``pp`` micro-batches; one that stops (EOS, a stop string) may have one decode more computed
    and dropped. None (default): on where it overlaps something, pp > 1 or a GPU (at pp=1 on
    the CPU the worker runs in the engine's thread: nothing to overlap); the engine resolves
    it (``EngineConfig``)."""
    stage_layers: list[int] | None = None
    """Layers per stage, overriding the cost-balanced plan (whole layers; must sum to the
    model's layers)."""
    host: str | None = None
    """Address the engine binds its ZeroMQ sockets to; None = 127.0.0.1 on one node, the
    rendezvous host's interface (torchrun's MASTER_ADDR) across nodes. Never all interfaces."""
    liveness_timeout_s: float = 10.0
    """A worker silent this long is declared dead; workers exit when the engine is."""

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1:
            raise ValueError(f"parallel.tp and parallel.pp must be >= 1, got tp={self.tp} pp={self.pp}")
        if self.num_microbatches_in_flight is not None and self.num_microbatches_in_flight < 1:
            raise ValueError("num_microbatches_in_flight must be >= 1")
        if self.stage_layers is not None:
            self._check_stage_layers(self.stage_layers)
        if not 0 < self.liveness_timeout_s <= 30:
            raise ValueError("liveness_timeout_s must be in (0, 30]")

    def _check_stage_layers(self, counts: list[int]) -> None:
        """What needs no model: one entry per stage, each a positive number of whole layers. The
        model's layer count is checked by the plan."""
        if len(counts) != self.pp:
            raise ValueError(f"stage_layers has {len(counts)} entries for pp={self.pp}")
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in counts):
            raise ValueError(f"stage_layers entries must be positive integers (whole layers), got {counts}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def bind_host(self) -> str:
        return self.host or "127.0.0.1"

    @property
    def feedback(self) -> bool:
        """Token feedback is on: asked for, or left to the default where there is a pipeline
        (``EngineConfig`` also turns it on at pp=1 on a GPU)."""
        return self.pp > 1 if self.token_feedback is None else self.token_feedback

    @property
    def feedback_distance(self) -> int | None:
        """With token feedback, the micro-batches between a request's sampling step and its next
        decode (``SchedulerLimits.feedback_distance``): pp; None without feedback."""
        return self.pp if self.feedback else None

    @property
    def depth(self) -> int:
        return self.num_microbatches_in_flight or (self.pp + 1 if self.feedback else self.pp)


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    model: str | None = None
    """Hugging Face folder or .gguf file; None = the embedded SmolLM2-135M-Instruct GGUF."""
    load_format: str = "auto"
    """auto = read the weights; dummy = random weights of the checkpoint's shape (benchmarks)."""
    dtype: str = "auto"
    """float32, bfloat16 or float16; auto = bfloat16 on CUDA, float32 on CPU."""
    quantization: str | None = None
    """fp8 = the decoder's projections in FP8 with a scale per output row, a float checkpoint
    quantized as it loads (half the weight memory: more KV blocks, a lower decode floor; FP8
    tensor cores, Ada or Hopper, on CUDA; a dequantizing reference on the CPU); None = as the
    checkpoint stores them (an FP8 checkpoint runs in FP8)."""
    device: str = "auto"
    """cpu, cuda, cuda:N; auto = cuda when available."""
    block_size: int = 16
    """Tokens per KV-cache block."""
    num_kv_blocks: int | None = None
    """KV blocks in the pool; None = sized from memory (kv_cache_memory_gb on CPU)."""
    kv_cache_memory_gb: float = 1.0
    """CPU only: memory given to the KV pool when num_kv_blocks is None."""
    gpu_memory_utilization: float = 0.90
    """CUDA only: fraction of the card the process may use (weights + activations + KV)."""
    max_model_len: int | None = None
    """Longest prompt + output; None = the model's context length."""
    kernel_backend: str = "auto"
    """Hot operations (norm, RoPE, SiLU·mul, KV write, attention): torch references, triton
    kernels, or auto (Triton on CUDA, torch elsewhere)."""
    seed: int = 0
    """Seed of the global generator (requests without their own seed draw from it)."""
    cuda_graph_max_batch: int = 256
    """Decode-only micro-batches of up to this many sequences replay a CUDA graph captured at
    start-up (per stage, bucketed by batch size; CUDA with the Triton kernels only); 0 = always
    run eagerly."""
    cuda_graph_max_tokens: int = 4096
    """Other micro-batches (prompt chunks, with or without decodes) of up to this many tokens
    replay a CUDA graph too, bucketed by token count (multiples of 16 up to 512, then of 32
    up to 1024, …; the step is padded; never past the scheduler's budget): launching an 8B
    stage's kernels one by one takes the host longer than the device needs to run a 512-token
    chunk, and at tp=2 longer than a 2,048-token step. 0 = run them eagerly. Not in
    deterministic mode."""
    split_decode_attention: bool = True
    """Decode-only micro-batches too small to fill the GPU cut each context's keys into ranges
    run by programs of their own, merged after (flash-decoding; ``kernels/paged_decode.py``):
    otherwise a few decodes over long contexts leave most of the GPU idle. Triton kernels only,
    never in deterministic mode. False: one program per sequence and KV head."""
    deterministic: bool = False
    """Deterministic, layout-invariant serving: a token's output is the same bits whatever
    else shares its micro-batch and whatever the tp/pp layout (batch-invariant Triton kernels,
    float32 partial sums reduced in a fixed tree, float32 logits). Needs the Triton kernels
    (CUDA, or TRITON_INTERPRET=1); slower than the default."""
    reduction_splits: int = 0
    """Deterministic mode: segments of every row-parallel input, reduced in float32 in one fixed
    tree. Runs compared bit for bit must share it, and each run's tp must divide it (a power of
    two, or equal it): e.g. 2 to match one GPU with tp=2. 0 = this run's tp."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be fp8 or null, got {self.quantization!r}")
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(f"kernel_backend must be one of {KERNEL_BACKENDS}, got {self.kernel_backend!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError("kv_cache_memory_gb must be > 0")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.reduction_splits < 0:
            raise ValueError(f"reduction_splits must be >= 0, got {self.reduction_splits}")
        if self.deterministic:
            from pipeserve.parallel.tp_layers import check_reduction_splits

            if self.kernel_backend == "torch":
                raise ValueError("deterministic mode needs kernel_backend auto or triton, not torch")
            check_reduction_splits(self.effective_reduction_splits, self.parallel.tp)
        if self.cuda_graph_max_batch < 0:
            raise ValueError(f"cuda_graph_max_batch must be >= 0, got {self.cuda_graph_max_batch}")
        if self.cuda_graph_max_tokens < 0:
            raise ValueError(f"cuda_graph_max_tokens must be >= 0, got {self.cuda_graph_max_tokens}")
        if self.parallel.token_feedback is None and self.parallel.pp == 1:  # (see ParallelConfig.token_feedback)
            on_gpu = self.device != "cpu" and self.torch_device().type != "cpu"
            object.__setattr__(self, "parallel", replace(self.parallel, token_feedback=on_gpu))

    @property
    def effective_reduction_splits(self) -> int:
        return self.reduction_splits or self.parallel.tp

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            return torch.device(self.device)
        except RuntimeError as e:
            raise ValueError(f"bad device {self.device!r}: {e}") from None

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return _DTYPES[self.dtype]


def engine_config_to_dict(config: EngineConfig) -> dict:
    """Plain data (for the workers' environment; JSON, never pickle)."""
    import dataclasses

    return dataclasses.asdict(config)


def engine_config_from_dict(d: dict) -> EngineConfig:
    d = dict(d)
    return EngineConfig(
        scheduler=SchedulerConfig(**d.pop("scheduler")),
        parallel=ParallelConfig(**d.pop("parallel")),
        **d,
    )
