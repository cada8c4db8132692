"""The OpenAI HTTP API's request bodies (validated strictly) and error bodies.

Requests are parsed from the raw JSON bytes with pydantic in strict mode: a wrong type is an
error rather than a silent coercion ("10" is not 10), and OpenAI fields we do not implement are
accepted only at their no-op values. Unknown fields are accepted and ignored, as vLLM does
(benchmark clients and SDKs send their own extras); ``ignored_fields`` names them so the server
can say so in its log. Value ranges (``temperature``, ``top_p``, ``max_tokens``, ``n``, ``stop``, ``logprobs`` …) are
checked once, by ``SamplingParams``.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from pipeserve.runtime.serving.tool_calls import named_schema, required_schema
from pipeserve.scheduler.sampling_params import StructuredOutputsParams


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
    # Known fields keep strict types; unknown ones are kept aside (model_extra) and ignored.
    model_config = ConfigDict(extra="allow", strict=True, use_attribute_docstrings=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    """Send one last chunk with the usage of the whole request (and "usage": null before)."""


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None
    """{"name", "schema", "strict"}: the output is JSON valid against "schema"."""


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
    presence_penalty: float | None = None
    """In [-2, 2]: subtracted from the logit of each token the output holds already."""
    frequency_penalty: float | None = None
    """In [-2, 2]: subtracted from a token's logit once per time the output holds it."""
    logit_bias: dict[str, float] | None = None
    """Token id (a string, as OpenAI sends it) -> bias in [-100, 100] added to its logit."""
    # vLLM's extensions.
    repetition_penalty: float | None = None
    """> 0: divides the positive logits (multiplies the negative ones) of tokens the prompt or
    output holds."""
    allowed_token_ids: list[int] | None = None
    """Only these tokens may be generated."""
    bad_words: list[str] | None = None
    """Words never to generate."""
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    spaces_between_special_tokens: bool = True
    """vLLM's; accepted and without effect, as in vLLM with a fast tokenizer: the byte-level
    detokenizer joins token texts as they are, so special tokens are never spaced apart."""
    truncate_prompt_tokens: int | None = None
    """Keep only the last k tokens of each prompt (k >= 1), as vLLM does."""
    prompt_logprobs: int | None = None
    """vLLM's: return each prompt token's logprob and this many top alternatives at its
    position (``prompt_logprobs`` in the response; not with ``stream``)."""
    # Structured outputs: OpenAI's response_format, vLLM's guided_* fields and its
    # structured_outputs object; at most one constraint per request.
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    """The output is JSON valid against this schema."""
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    """EBNF (xgrammar's dialect, ``root ::= ...``)."""
    structured_outputs: dict[str, Any] | None = None
    """vLLM's {"json" | "regex" | "choice" | "grammar" | "json_object": ...}."""

    def check_unsupported(self) -> None:
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            raise ApiError(400, f"truncate_prompt_tokens must be >= 1, got {self.truncate_prompt_tokens}",
                           param="truncate_prompt_tokens")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
        if self.stream and self.prompt_logprobs:  # (vLLM accepts a streamed 0)
            raise ApiError(400, "prompt_logprobs are not available with stream: true", param="prompt_logprobs")

    def sampling_fields(self) -> dict[str, Any]:
        """SamplingParams keyword arguments (OpenAI's defaults where a field is absent)."""
        fields = dict(temperature=1.0 if self.temperature is None else self.temperature,
                      top_p=1.0 if self.top_p is None else self.top_p, seed=self.seed, stop=self.stop)
        for name in ("top_k", "min_p", "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens",
                     "include_stop_str_in_output", "presence_penalty", "frequency_penalty", "repetition_penalty",
                     "allowed_token_ids", "bad_words", "prompt_logprobs"):
            if (value := getattr(self, name)) is not None:
                fields[name] = value
        if self.logit_bias is not None:
            fields["logit_bias"] = _token_id_keys(self.logit_bias)
        if (structured := self._structured_outputs()) is not None:
            fields["structured_outputs"] = structured
        return fields

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        given = self._constraints()
        if len(given) > 1:
            raise ApiError(400, f"give one structured-output constraint, got {', '.join(given)}",
                           param=next(iter(given)))
        if not given:
            return None
        (name, fields), = given.items()
        try:
            return StructuredOutputsParams(**fields)
        except (TypeError, ValueError) as e:
            raise ApiError(400, str(e), param=name) from None

    def _constraints(self) -> dict[str, dict[str, Any]]:
        """Request field -> the StructuredOutputsParams fields it asks for."""
        given: dict[str, dict[str, Any]] = {}
        if self.response_format is not None and self.response_format.type != "text":
            given["response_format"] = _response_format_constraint(self.response_format)
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            if (value := getattr(self, name)) is not None:
                given[name] = {kind: value}
        if self.structured_outputs is not None:
            given["structured_outputs"] = self.structured_outputs
        return given


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    """Prepend each prompt's text to its choices' text (and with ``logprobs``, the prompt's
    tokens to the choices' logprobs)."""
    suffix: str | None = None
    best_of: int | None = None
    """Accepted when null or equal to n: extra candidates to rank are not generated (nor by vLLM's engine)."""

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.suffix:
            raise ApiError(400, "suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise ApiError(400, f"best_of is not supported: it must be null or equal to n ({self.n}), "
                           f"got {self.best_of}", param="best_of")

    def sampling_fields(self) -> dict[str, Any]:
        """With ``echo`` and ``logprobs``, the prompt's logprobs are computed too (as vLLM:
        ``prompt_logprobs`` when given, else ``logprobs`` of them)."""
        fields = super().sampling_fields()
        if self.echo and self.logprobs is not None and self.prompt_logprobs is None:
            fields["prompt_logprobs"] = self.logprobs
        return fields

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


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """The arguments' JSON schema (None: any object)."""
    strict: bool | None = None


class Tool(_Strict):
    """OpenAI's function tool."""

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(_Strict):
    name: str
    arguments: str
    """The arguments object as JSON text."""


class MessageToolCall(_Strict):
    """A tool call in an assistant message of the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction

    def as_template_input(self) -> dict:
        # Templates write the arguments with tojson: given the object, as transformers' callers
        # and vLLM give it, not its text (which would be quoted once more).
        try:
            arguments = json.loads(self.function.arguments)
        except (json.JSONDecodeError, RecursionError):  # not JSON (or nested too deep): as given
            arguments = self.function.arguments
        call = {"type": self.type, "function": {"name": self.function.name, "arguments": arguments}}
        return call if self.id is None else {"id": self.id, **call}


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    """An assistant message's tool calls."""
    tool_call_id: str | None = None
    """A tool message's: the tool call it answers."""

    def as_template_input(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls is not None:
            message["tool_calls"] = [call.as_template_input() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    """End the prompt with the template's opening of an assistant message."""
    continue_final_message: bool = False
    """Render the last message open (no end-of-message marker after it), so the answer continues it."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the chat template (e.g. {"enable_thinking": false})."""
    special_tokens_in_content: bool = False
    """Let a special token's text in a message's content become that token (raw control of the
    prompt); by default it stays text, so content cannot open a message of its own."""
    tools: list[Tool] | None = None
    """Functions the model may call; the chat template renders them."""
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """"auto" (the default with tools: tool calls are parsed from the output, which needs
    server.enable_auto_tool_choice), "none" (no parsing), "required" (one tool call or more) or a
    named function (a tool call of it); the last two constrain the output."""
    parallel_tool_calls: bool = True
    """False: at most one tool call."""

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if not self.messages:
            raise ApiError(400, "messages must not be empty", param="messages")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        names = [tool.function.name for tool in self.tools or []]
        if len(set(names)) != len(names):
            raise ApiError(400, "tools must have distinct function names", param="tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ApiError(400, f"tool_choice names the function {self.tool_choice.function.name!r}, which is "
                           "not among the tools", param="tool_choice")
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs requires logprobs: true", param="top_logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ApiError(400, "give max_tokens or max_completion_tokens, not both", param="max_tokens")
        if self.continue_final_message and self.add_generation_prompt:
            raise ApiError(400, "continue_final_message and add_generation_prompt cannot both be true "
                           "(send add_generation_prompt: false)", param="continue_final_message")

    @property
    def effective_tool_choice(self) -> str:
        """"none", "auto", "required" or "named" (OpenAI's default: "auto" with tools)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or ("auto" if self.tools else "none")

    def _constraints(self) -> dict[str, dict[str, Any]]:
        given = super()._constraints()
        if self.effective_tool_choice == "required":
            given["tool_choice"] = {"json": required_schema(template_tools(self.tools), self.parallel_tool_calls)}
        elif self.effective_tool_choice == "named":
            given["tool_choice"] = {"json": named_schema(template_tools(self.tools), self.tool_choice.function.name)}
        return given

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None (no logprobs) or how many top alternatives."""
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeCompletionRequest(_Strict):
    """POST /tokenize with a prompt (vLLM's)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    """Add what the model puts before a prompt (its BOS token, if it asks for one)."""
    return_token_strs: bool = False
    """Also answer each token's text (``token_strs``)."""


class TokenizeChatRequest(_Strict):
    """POST /tokenize with chat messages, rendered as /v1/chat/completions renders them (vLLM's)."""

    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    add_special_tokens: bool = False
    """Add BOS before the rendering (templates usually write their own special tokens)."""
    return_token_strs: bool = False

    def check_unsupported(self) -> None:
        if not self.messages:
            raise ApiError(400, "messages must not be empty", param="messages")
        if self.continue_final_message and self.add_generation_prompt:
            raise ApiError(400, "continue_final_message and add_generation_prompt cannot both be true "
                           "(send add_generation_prompt: false)", param="continue_final_message")


class DetokenizeRequest(_Strict):
    """POST /detokenize (vLLM's)."""

    model: str | None = None
    tokens: list[int]


def template_tools(tools: list[Tool] | None) -> list[dict] | None:
    """The tools as chat templates take them (transformers' form: OpenAI's tool objects)."""
    return None if not tools else [tool.model_dump(exclude_none=True) for tool in tools]


def _response_format_constraint(fmt: ResponseFormat) -> dict[str, Any]:
    if fmt.type == "json_object":
        return {"json_object": True}
    schema = (fmt.json_schema or {}).get("schema")
    if not isinstance(schema, dict):
        raise ApiError(400, 'response_format json_schema needs {"name": ..., "schema": {...}}',
                       param="response_format")
    return {"json": schema}


def _token_id_keys(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's logit_bias keys are token ids written as strings ("123")."""
    out = {}
    for key, value in bias.items():
        if not key.isdecimal():
            raise ApiError(400, f"logit_bias keys must be token ids (non-negative integers), got {key!r}",
                           param="logit_bias")
        out[int(key)] = value
    return out


def ignored_fields(request: BaseModel, prefix: str = "") -> list[str]:
    """The unknown fields of a parsed request, nested ones included ("messages.tool_calls")."""
    names = [prefix + name for name in request.model_extra or {}]
    for name in type(request).model_fields:
        value = getattr(request, name)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, BaseModel):
                names += [n for n in ignored_fields(item, f"{prefix}{name}.") if n not in names]
    return names


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
