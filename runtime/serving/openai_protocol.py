"""The OpenAI HTTP API's request bodies (validated strictly) and error bodies.

Requests are parsed from the raw JSON bytes with pydantic in strict mode: a wrong type is an
error rather than a silent coercion ("10" is not 10), unknown fields are errors, and OpenAI
fields we do not implement are accepted only at their no-op values. Value ranges (temperature,
top_p, max_tokens, n, stop, logprobs …) are checked once, by ``SamplingParams``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError


class ApiError(Exception):
    """An error answered with an OpenAI-style body: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """The body of every 4xx/5xx answer (what ``ApiError.body`` makes); for the OpenAPI document."""

    error: ErrorInfo


class _Strict(BaseModel):
    # Field docstrings become their descriptions in the OpenAPI document (/openapi.json).
    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    """Send one last chunk with the usage of the whole request (and "usage": null before)."""


class _SamplingRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # OpenAI fields accepted only at their no-op values.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions.
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None

    def check_unsupported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise ApiError(400, f"{name} is not supported (only 0)", param=name)
        if self.logit_bias:
            raise ApiError(400, "logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")

    def sampling_fields(self) -> dict[str, Any]:
        """SamplingParams keyword arguments (OpenAI's defaults where a field is absent)."""
        fields = dict(temperature=1.0 if self.temperature is None else self.temperature,
                      top_p=1.0 if self.top_p is None else self.top_p, seed=self.seed, stop=self.stop)
        for name in ("top_k", "min_p", "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens",
                     "include_stop_str_in_output"):
            if (value := getattr(self, name)) is not None:
                fields[name] = value
        return fields


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        if self.suffix:
            raise ApiError(400, "suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise ApiError(400, "best_of is not supported (only best_of == n)", param="best_of")

    def prompts(self) -> list[str | list[int]]:
        """The prompts of a batch, each a string or token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise ApiError(400, "prompt is empty", param="prompt")
        return list(p)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_input(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    special_tokens_in_content: bool = False
    """Let a special token's text in a message's content become that token (raw control of the
    prompt); by default it stays text, so content cannot open a turn of its own."""

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if not self.messages:
            raise ApiError(400, "messages must not be empty", param="messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs requires logprobs: true", param="top_logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ApiError(400, "give max_tokens or max_completion_tokens, not both", param="max_tokens")

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None (no logprobs) or how many top alternatives."""
        return (self.top_logprobs or 0) if self.logprobs else None


def parse(model: type[BaseModel], body: bytes):
    """A request model from raw JSON bytes; ApiError(400) naming the first bad field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise _bad_request(e) from None


def _bad_request(e: ValidationError) -> ApiError:
    errors = e.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {first['msg']}", code="invalid_json")
    if first["type"] == "model_type" or not first["loc"]:
        return ApiError(400, "the body must be a JSON object", code="invalid_json")
    param = str(first["loc"][0])
    details = "; ".join(f"{_loc(err['loc'])}: {err['msg']}" for err in errors[:3])
    return ApiError(400, f"invalid request: {details}", param=param)


def _loc(loc: tuple) -> str:
    # Drop the union-member tags pydantic adds ("str", "list[int]", …) from the path.
    return ".".join(str(x) for x in loc if isinstance(x, int) or ("[" not in x and x not in ("str", "int")))
