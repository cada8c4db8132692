"""pipeserve: pipeline-parallel LLM serving with chunked-prefill (Sarathi-Serve) scheduling."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy so that `import pipeserve.scheduler` never pulls in torch.
    if name in ("LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"):
        from pipeserve.runtime.engine import llm

        return getattr(llm, name)
    raise AttributeError(name)
