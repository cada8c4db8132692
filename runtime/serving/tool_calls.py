"""Tool calling for /v1/chat/completions: the calls in a model's output, and the constraints
that make ``tool_choice: "required"`` or a named function produce calls.

    parser = ToolCallParser.of("hermes")                    # or "llama3_json"
    for piece in parser.feed(text_delta): ...               # str (content) or ToolCall
    for piece in parser.finish(): ...
    content, calls = parse_tool_calls("hermes", text)       # the same pieces, collected

One streaming parser per format serves both answers: the non-streamed one feeds the whole text
at once, so a stream's deltas always add up to the non-streamed message, however the text was
split. A call is emitted once it is complete (its arguments as one piece); text around the calls
is content, except whitespace next to a call. Text that looks like a call but is not one (bad
JSON, no name) is content, as written.

``tool_choice: "required"`` and a named function need no parser: the output is constrained to
JSON (``required_schema``, ``named_schema``, vLLM's schemas) and read by ``calls_from_required``.
"""

from __future__ import annotations

import abc
import json
import uuid
from dataclasses import dataclass
from typing import Any

PARSERS = ("hermes", "llama3_json")


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str
    """The arguments object as JSON text."""

    def as_openai(self, call_id: str) -> dict:
        return {"id": call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ToolCallParser(abc.ABC):
    """Splits streamed text into content and complete calls (``feed``, then ``finish``); one
    subclass per output format."""

    @staticmethod
    def of(name: str) -> ToolCallParser:
        return {"hermes": HermesParser, "llama3_json": Llama3JsonParser}[name]()

    def __init__(self) -> None:
        self._space = ""  # whitespace held back: dropped next to a call, kept before more content
        self.num_calls = 0

    @abc.abstractmethod
    def feed(self, text: str) -> list[str | ToolCall]:
        """The pieces that ``text`` (the next part of the output) completes, in order."""

    @abc.abstractmethod
    def finish(self) -> list[str | ToolCall]:
        """The pieces still held back once the output has ended."""

    def _content(self, text: str) -> list[str | ToolCall]:
        held = self._space + text
        kept = held.rstrip()
        self._space = held[len(kept):]
        return [kept] if kept else []

    def _call(self, call: ToolCall) -> list[str | ToolCall]:
        self._space = ""
        self.num_calls += 1
        return [call]

    def _end(self) -> list[str | ToolCall]:
        space, self._space = self._space, ""
        return [space] if space and not self.num_calls else []


class HermesParser(ToolCallParser):
    """Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number,
    anywhere in the text; an unclosed last one is read up to the end of the output."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""
        self._in_call = False

    def feed(self, text: str) -> list[str | ToolCall]:
        self._buffer += text
        out: list[str | ToolCall] = []
        while True:
            if self._in_call:
                end = self._buffer.find(self.CLOSE)
                if end < 0:
                    return out
                out += self._body(self._buffer[:end], closed=True)
                self._buffer, self._in_call = self._buffer[end + len(self.CLOSE):], False
            else:
                start = self._buffer.find(self.OPEN)
                if start < 0:  # keep back what may be the start of a tag
                    keep = _partial_suffix(self._buffer, self.OPEN)
                    out += self._content(self._buffer[:len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    return out
                out += self._content(self._buffer[:start])
                self._buffer, self._in_call = self._buffer[start + len(self.OPEN):], True

    def finish(self) -> list[str | ToolCall]:
        rest, self._buffer = self._buffer, ""
        out = self._body(rest, closed=False) if self._in_call else self._content(rest)
        return out + self._end()

    def _body(self, body: str, closed: bool) -> list[str | ToolCall]:
        call = _call_of(body.strip(), "arguments")
        if call is None:
            return self._content(self.OPEN + body + (self.CLOSE if closed else ""))
        return self._call(call)


class Llama3JsonParser(ToolCallParser):
    """Llama 3.x's JSON calls: an output that starts (after ``<|python_tag|>``, if the special
    tokens are kept) with ``{"name": ..., "parameters": {...}}`` ("arguments" too), several
    separated by ";". Such an output is held to its end and is all calls or all content."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""
        self._mode: str | None = None  # "calls" or "content" once the output's start tells

    def feed(self, text: str) -> list[str | ToolCall]:
        if self._mode == "content":
            return self._content(text)
        self._buffer += text
        if self._mode is None:
            head = self._buffer.lstrip()
            if not head or (self.TAG.startswith(head) and head != self.TAG):
                return []
            self._mode = "calls" if head.startswith(("{", self.TAG)) else "content"
            if self._mode == "content":
                text, self._buffer = self._buffer, ""
                return self._content(text)
        return []

    def finish(self) -> list[str | ToolCall]:
        text, self._buffer = self._buffer, ""
        if self._mode == "calls" and (calls := _llama_calls(text.strip().removeprefix(self.TAG))):
            return [piece for call in calls for piece in self._call(call)]
        return self._content(text) + self._end()


def _llama_calls(text: str) -> list[ToolCall] | None:
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while True:
        try:
            value, pos = decoder.raw_decode(text, pos)
        except (json.JSONDecodeError, RecursionError):  # RecursionError: nested too deep
            return None
        call = _call_of(value, "parameters" if isinstance(value, dict) and "parameters" in value else "arguments")
        if call is None:
            return None
        calls.append(call)
        rest = text[pos:].lstrip()
        if not rest:
            return calls
        if not rest.startswith(";"):
            return None
        pos = len(text) - len(rest[1:].lstrip())


def _call_of(value: str | Any, arguments_key: str) -> ToolCall | None:
    """The call in a JSON object (or its text) {"name": str, arguments_key: object}, else None."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError):  # RecursionError: nested too deep
            return None
    if (not isinstance(value, dict) or not isinstance(value.get("name"), str)
            or not isinstance(value.get(arguments_key, {}), dict)):
        return None
    return ToolCall(value["name"], json.dumps(value.get(arguments_key, {}), ensure_ascii=False))


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def parse_tool_calls(parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content or None, calls) of a whole output."""
    p = ToolCallParser.of(parser)
    pieces = p.feed(text) + p.finish()
    content = "".join(x for x in pieces if isinstance(x, str))
    return content or None, [x for x in pieces if isinstance(x, ToolCall)]


# ---- constrained tool choice ------------------------------------------------------------------


def named_schema(tools: list[dict], name: str) -> dict:
    """The output of ``tool_choice: {"function": {"name": name}}``: that function's arguments."""
    return next(t["function"] for t in tools if t["function"]["name"] == name).get("parameters") or {"type": "object"}


def required_schema(tools: list[dict], parallel: bool) -> dict:
    """The output of ``tool_choice: "required"``: a JSON array of one or more (one, unless
    ``parallel``) {"name": a tool's name, "parameters": its arguments}."""
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                             "parameters": t["function"].get("parameters") or {"type": "object"}},
              "required": ["name", "parameters"]} for t in tools]
    return {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}),
            "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}


def calls_from_required(text: str) -> list[ToolCall] | None:
    """The calls of a ``required_schema`` output; None where it is not one (cut short)."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):  # RecursionError: nested too deep
        return None
    calls = [_call_of(item, "parameters") for item in value] if isinstance(value, list) else [None]
    return None if None in calls else calls


# ---- one choice's calls, streamed or whole ----------------------------------------------------


class ChoiceToolCalls:
    """One choice's output read for calls, by ``tool_choice``: "auto" (``parser``), "required"
    or "named" (the constrained JSON). ``feed``/``finish`` give OpenAI's stream deltas (content
    or ``tool_calls``: a call's first delta has its index, id, type, name and arguments so far;
    later ones its index and more arguments); ``message`` the non-streamed message's fields."""

    def __init__(self, tool_choice: str, *, parser: str | None = None, function: str | None = None,
                 parallel: bool = True) -> None:
        assert tool_choice in ("auto", "required", "named")
        self.tool_choice, self.function, self.parallel = tool_choice, function, parallel
        self._parser = ToolCallParser.of(parser) if tool_choice == "auto" else None
        self._text = ""  # the "required" output, read at its end
        self.num_calls = 0

    def feed(self, text: str) -> list[dict]:
        if self._parser is not None:
            return self._deltas(self._parser.feed(text))
        if self.tool_choice == "required":
            self._text += text
            return []
        if not text:
            return []
        if self.num_calls == 0:  # the named function's arguments, streamed as they come
            return self._deltas([ToolCall(self.function, text)])
        return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}]

    def finish(self) -> list[dict]:
        if self._parser is not None:
            return self._deltas(self._parser.finish())
        if self.tool_choice == "required":
            calls = calls_from_required(self._text)
            return self._deltas(calls if calls is not None else [self._text] if self._text else [])
        return []

    def message(self, text: str) -> tuple[str | None, list[dict]]:
        """(content or None, tool_calls) of the whole output."""
        content, calls = "", []
        for delta in self.feed(text) + self.finish():
            content += delta.get("content", "")
            for call in delta.get("tool_calls", []):
                if "id" in call:
                    calls.append({k: call[k] for k in ("id", "type")} | {"function": dict(call["function"])})
                else:
                    calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
        return content or None, calls

    def _deltas(self, pieces: list[str | ToolCall]) -> list[dict]:
        out = []
        for piece in pieces:
            if isinstance(piece, str):
                out.append({"content": piece})
            elif self.parallel or self.num_calls == 0:  # parallel_tool_calls false: the first call only
                call = piece.as_openai(new_call_id())
                out.append({"tool_calls": [{"index": self.num_calls, **call}]})
                self.num_calls += 1
        return out
