"""Tool calling for /v1/chat/completions: the tool calls in a model's output, and the constraints
that make ``tool_choice: "required"`` or a named function produce tool calls.

    parser = ToolCallParser.of("hermes")                    # or "llama3_json"
    for piece in parser.feed(text_delta): ...               # str, ToolCall or MoreArguments
    for piece in parser.finish(): ...
    content, calls = parse_tool_calls("hermes", text)       # the same pieces, collected

One streaming parser per format serves both answers: the non-streamed one feeds the whole text
at once, and every decision depends on the text read so far, never on how it was split, so a
stream's pieces always add up to the non-streamed message.

A tool call begins (``ToolCall``, its name, its arguments to follow) once the output holds its head,
``{"name": "<name>", "arguments": `` followed by ``{`` (any JSON whitespace between; Llama 3
may write "parameters"), and its arguments then come as the model writes them
(``MoreArguments``). Text is held back only while it may still become a tool call: a partial
``<tool_call>`` tag; the start of a Llama 3 or "required" output, and what follows a tool call there
(a separator); an incomplete head (so a name always goes out whole); an object without a head
until it ends (Hermes: until ``</tool_call>``), since a tool call object whose name is not its first
member is a tool call all the same, sent whole; inside the arguments, only an incomplete token (a
number or literal until the character after it, a string escape). An object that is not a tool call
(bad JSON, no name, no arguments object) is content, as written. Text around the tool calls is
content, except whitespace next to a tool call; text still held when the output ends (cut inside a
head) is content as written.

The arguments are written as ``json.dumps(arguments, ensure_ascii=False)`` writes them
(``", "`` and ``": "``, its string escapes, numbers as Python writes them; a repeated key kept,
a lone surrogate, which UTF-8 cannot carry, escaped), token by token as they are read
(``_JsonReader``): the same text, streamed or not. Once a tool call has begun it stays
a tool call: if its JSON breaks, the arguments end there (not valid JSON, as a cut output's are) and
the rest of the tool call is dropped.

``tool_choice: "required"`` and a named function constrain the output to JSON
(``required_schema``, ``named_schema``, vLLM's schemas), read by the same machinery: a JSON array
of tool calls, or one tool call's arguments object.
"""

from __future__ import annotations

import abc
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

PARSERS = ("hermes", "llama3_json")


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A tool call: its name, and its arguments as JSON text (as far as they are read, when streamed)."""

    name: str
    arguments: str

    def as_openai(self, call_id: str) -> dict:
        return {"id": call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class MoreArguments:
    """The next text of the last tool call's arguments."""

    text: str


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


# ---- JSON as it streams ------------------------------------------------------------------------

_SPACE = re.compile(r"[ \t\n\r]*")
_CHAR = r'[^"\\\x00-\x1f]'
_STRING = re.compile(rf'"(?:{_CHAR}|\\["\\/bfnrt]|\\u[0-9a-fA-F]{{4}})*"')
_OPEN_STRING = re.compile(rf'"(?:{_CHAR}|\\["\\/bfnrt]|\\u[0-9a-fA-F]{{4}})*(?:\\(?:u[0-9a-fA-F]{{0,3}})?)?')
# A string's characters and escapes that decode alone: a high surrogate's escape only once the
# text after it shows whether a low one follows (json pairs them).
_STRING_PART = re.compile(
    rf'(?:{_CHAR}+|\\["\\/bfnrt]|\\u(?![dD][89abAB])[0-9a-fA-F]{{4}}'
    r'|\\u[dD][89abAB][0-9a-fA-F]{2}(?:\\u[dD][c-fC-F][0-9a-fA-F]{2}|(?=[^\\]|\\[^u]|\\u[0-9a-fA-F]{4})))+')
_ESCAPE_START = re.compile(r"\\(?:u[0-9a-fA-F]{0,4}(?:\\(?:u[0-9a-fA-F]{0,3})?)?)?")
_BARE = re.compile(r"[-+.0-9a-zA-Z]+")
_BARE_TOKEN = re.compile(r"true|false|null|-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_OPENER = {"}": "{", "]": "["}


def _utf8(text: str) -> str:
    """``text`` with each lone surrogate (which UTF-8 cannot carry) as its ``\\u`` escape."""
    return _LONE_SURROGATE.sub(lambda m: f"\\u{ord(m[0]):04x}", text)


def _dumps(value: Any) -> str:
    """``json.dumps(value, ensure_ascii=False)``, UTF-8 safe."""
    return _utf8(json.dumps(value, ensure_ascii=False))


class _JsonReader:
    """Reads one JSON value from text that comes in pieces, and writes it as ``_dumps`` writes
    the value it parses to, token by token: a string's characters as they come, a number or
    literal once the character after it shows it whole. Keys stay in their order, a repeated
    one too."""

    def __init__(self, *, in_object: bool = False) -> None:
        # in_object: start inside an object, after one of its values (to read the rest of it)
        self._open: list[str] = ["{"] if in_object else []  # the open containers
        # What comes next: "value"; "{" or "[" (a container's first value or key, or its close);
        # "key"; ":"; "," (a separator or a close); "string" (inside one; a key's if _key).
        self._next = "," if in_object else "value"
        self._key = False
        self.done = self.broken = False

    def read(self, text: str) -> tuple[str, int]:
        """(what ``text`` writes, how many of its characters were read). Reading ends at the
        value's end (``done``), at a character JSON does not allow there (``broken``), or before a
        token that ``text`` does not hold whole."""
        out, pos = [], 0
        while pos < len(text) and not (self.done or self.broken):
            step = self._string(text, pos) if self._next == "string" else self._token(text, pos)
            if step is None:
                break
            out.append(step[0])
            pos = step[1]
        return "".join(out), pos

    def _token(self, text: str, pos: int) -> tuple[str, int] | None:
        c, expect = text[pos], self._next
        if c in " \t\n\r":
            return "", _SPACE.match(text, pos).end()
        if c in _OPENER and expect in ("{", "[", ",") and self._open[-1:] == [_OPENER[c]]:
            self._open.pop()
            self._ended()
            return c, pos + 1
        if c == "," == expect:
            self._next = "key" if self._open[-1] == "{" else "value"
            return ", ", pos + 1
        if c == ":" == expect:
            self._next = "value"
            return ": ", pos + 1
        if c == '"' and expect in ("value", "[", "key", "{"):
            self._next, self._key = "string", expect in ("key", "{")
            return '"', pos + 1
        if expect in ("value", "["):
            if c in "{[":
                self._open.append(c)
                self._next = c
                return c, pos + 1
            if bare := _BARE.match(text, pos):
                return None if bare.end() == len(text) else self._bare(bare.group(), bare.end())
        self.broken = True
        return None

    def _string(self, text: str, pos: int) -> tuple[str, int] | None:
        if part := _STRING_PART.match(text, pos):
            return _dumps(json.loads(f'"{part.group()}"'))[1:-1], part.end()
        if text[pos] == '"':
            if self._key:
                self._next = ":"
            else:
                self._ended()
            return '"', pos + 1
        if not _ESCAPE_START.fullmatch(text, pos):  # else an incomplete escape
            self.broken = True
        return None

    def _bare(self, token: str, end: int) -> tuple[str, int] | None:
        """A number, true, false or null, as json reads and writes it."""
        if _BARE_TOKEN.fullmatch(token):
            try:
                written = _dumps(json.loads(token))
            except ValueError:  # an integer longer than Python reads
                pass
            else:
                self._ended()
                return written, end
        self.broken = True
        return None

    def _ended(self) -> None:
        """A value ended: the whole one, or one inside a container."""
        if self._open:
            self._next = ","
        else:
            self.done = True


def _head(text: str, keys: tuple[str, ...]) -> tuple[str, int] | bool:
    """A tool call's head at the start of ``text``: ``{"name": "<name>", "<one of keys>": `` before
    ``{``, JSON whitespace between. (the name, where its arguments begin) once ``text`` holds
    it whole; else whether ``text`` may still become one."""
    pos, name = 0, ""
    for options in (("{",), ('"name"',), (":",), None, (",",), tuple(f'"{k}"' for k in keys), (":",), ("{",)):
        pos = _SPACE.match(text, pos).end()
        if options is None:  # the name
            if not (string := _STRING.match(text, pos)):
                return pos == len(text) or _OPEN_STRING.fullmatch(text, pos) is not None
            name, pos = _utf8(json.loads(string.group())), string.end()
            continue
        rest = text[pos:]
        if not (hit := next((o for o in options if rest.startswith(o)), None)):
            return any(o.startswith(rest) for o in options)
        pos += len(hit)
    return name, pos - 1


def _call_of(value: str | Any, keys: tuple[str, ...]) -> ToolCall | None:
    """The tool call in a JSON object (or its text), ``{"name": str, one of keys: object}`` in any
    order (the first of keys it has), else None."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):  # RecursionError: nested too deep
            return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = next((value[k] for k in keys if k in value), None)
    return ToolCall(_utf8(value["name"]), _dumps(arguments)) if isinstance(arguments, dict) else None


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


# ---- the parsers -------------------------------------------------------------------------------

Piece = str | ToolCall | MoreArguments


class ToolCallParser(abc.ABC):
    """Splits streamed text into pieces (``feed``, then ``finish``): content (``str``), a tool call's
    start (``ToolCall``) and its arguments' next text (``MoreArguments``); one subclass per
    output format."""

    @staticmethod
    def of(name: str) -> ToolCallParser:
        return {"hermes": HermesParser, "llama3_json": Llama3JsonParser}[name]()

    def __init__(self) -> None:
        self._space = ""  # whitespace held back: dropped next to a tool call, kept before more content
        self._buffer = ""  # unread text
        self._json: _JsonReader | None = None  # a tool call's arguments, or the rest of its object
        self.num_calls = 0

    def feed(self, text: str) -> list[Piece]:
        """The pieces that ``text`` (the next part of the output) completes, in order."""
        self._buffer += text
        out: list[Piece] = []
        while self._step(out):
            pass
        return out

    @abc.abstractmethod
    def finish(self) -> list[Piece]:
        """The pieces still held back once the output has ended."""

    @abc.abstractmethod
    def _step(self, out: list[Piece]) -> bool:
        """Reads what it can of the buffer, adding the pieces to ``out``; False once it waits
        for more text."""

    def _content(self, text: str) -> list[Piece]:
        held = self._space + text
        kept = held.rstrip()
        self._space = held[len(kept):]
        return [kept] if kept else []

    def _call(self, call: ToolCall) -> list[Piece]:
        self._space = ""
        self.num_calls += 1
        return [call]

    def _begin(self, name: str) -> list[Piece]:
        """A tool call whose arguments the buffer goes on with."""
        self._json = _JsonReader()
        return self._call(ToolCall(name, ""))

    def _arguments(self) -> list[Piece]:
        """The arguments' next text that the buffer holds; it keeps what is not read."""
        text, n = self._json.read(self._buffer)
        self._buffer = self._buffer[n:]
        return [MoreArguments(text)] if text else []

    def _cut(self) -> list[Piece]:
        """The arguments' last token, as written, of an output that ended inside them."""
        rest, self._buffer = self._buffer, ""
        return [MoreArguments(rest)] if rest else []

    def _end(self) -> list[Piece]:
        space, self._space = self._space, ""
        return [space] if space and not self.num_calls else []


class HermesParser(ToolCallParser):
    """Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number,
    anywhere in the text; an unclosed last one is read up to the end of the output. After a
    tool call's arguments, the rest of its text up to ``</tool_call>`` is dropped."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    KEYS = ("arguments",)

    def __init__(self) -> None:
        super().__init__()
        # content; head (after <tool_call>); whole (a body read at its </tool_call>);
        # arguments; drop (the rest of a tool call, to its </tool_call>)
        self._state = "content"

    def _step(self, out: list[Piece]) -> bool:
        buffer = self._buffer
        if self._state == "content":
            start = buffer.find(self.OPEN)
            end = start if start >= 0 else len(buffer) - _partial_suffix(buffer, self.OPEN)
            out += self._content(buffer[:end])
            if start < 0:  # keep back what may be the start of a tag
                self._buffer = buffer[end:]
                return False
            self._buffer, self._state = buffer[start + len(self.OPEN):], "head"
        elif self._state == "head":
            end = buffer.find(self.CLOSE)
            head = _head(buffer if end < 0 else buffer[:end], self.KEYS)
            if head is True and end < 0:
                return False
            if isinstance(head, bool):
                self._state = "whole"
            else:
                out += self._begin(head[0])
                self._buffer, self._state = buffer[head[1]:], "arguments"
        elif self._state == "whole":
            end = buffer.find(self.CLOSE)
            if end < 0:
                return False
            out += self._body(buffer[:end], closed=True)
            self._buffer, self._state = buffer[end + len(self.CLOSE):], "content"
        elif self._state == "arguments":
            out += self._arguments()
            if not (self._json.done or self._json.broken):
                return False
            self._state = "drop"
        else:
            end = buffer.find(self.CLOSE)
            if end < 0:
                self._buffer = buffer[len(buffer) - _partial_suffix(buffer, self.CLOSE):]
                return False
            self._buffer, self._state = buffer[end + len(self.CLOSE):], "content"
        return True

    def finish(self) -> list[Piece]:
        if self._state == "arguments":
            return self._cut()
        rest, self._buffer = self._buffer, ""
        if self._state == "content":
            out = self._content(rest)
        else:
            out = self._body(rest, closed=False) if self._state in ("head", "whole") else []
        return out + self._end()

    def _body(self, body: str, closed: bool) -> list[Piece]:
        """A tool call body that has no head, read whole: a tool call, else content as written."""
        call = _call_of(body, self.KEYS)
        if call is None:
            return self._content(self.OPEN + body + (self.CLOSE if closed else ""))
        return self._call(call)


class _CallList(ToolCallParser):
    """Tool calls written as JSON objects one after another: the first after one of ``FIRST``, each
    other after one of ``BETWEEN``, then ``CLOSE`` (where the format has one). The first text that
    does not go on with tool calls ends them: from there on, the output is content as written. After
    a tool call's arguments, the rest of its object is dropped; once a tool call's JSON breaks, the rest
    of the output is."""

    FIRST: tuple[str, ...]
    BETWEEN: tuple[str, ...]
    CLOSE: str | None
    KEYS: tuple[str, ...]

    def __init__(self) -> None:
        super().__init__()
        # lead (before a tool call); object (one without a head, read to its end); arguments; rest
        # (of a tool call's object); content; drop
        self._state = "lead"
        self._start = self._read = 0  # "object": where it starts in the buffer, how far it is read

    def _step(self, out: list[Piece]) -> bool:
        if self._state == "lead":
            return self._lead(out)
        if self._state == "object":
            return self._object(out)
        if self._state in ("arguments", "rest"):
            if self._state == "arguments":
                out += self._arguments()
            else:
                self._buffer = self._buffer[self._json.read(self._buffer)[1]:]
            if not (self._json.done or self._json.broken):
                return False
            if self._json.broken:
                self._state = "drop"
            elif self._state == "arguments":
                self._json, self._state = _JsonReader(in_object=True), "rest"
            else:
                self._state = "lead"
            return True
        if self._state == "content":
            out += self._content(self._buffer)
        self._buffer = ""
        return False

    def _lead(self, out: list[Piece]) -> bool:
        """What follows the output's start or a tool call: another tool call (its head, or an object
        without one), the close, or content; or nothing."""
        text = self._buffer
        rest = text[_SPACE.match(text).end():]
        wait, start = False, None
        for lead in self.BETWEEN if self.num_calls else self.FIRST:
            if not rest.startswith(lead):
                wait |= lead.startswith(rest)
                continue
            after = len(text) - len(rest) + len(lead)
            head = _head(text[after:], self.KEYS)
            if isinstance(head, tuple):
                out += self._begin(head[0])
                self._buffer, self._state = text[after + head[1]:], "arguments"
                return True
            wait |= head
            after = _SPACE.match(text, after).end()
            if text.startswith("{", after):
                start = after
        if wait:
            return False
        if start is not None:
            self._json, self._state, self._start, self._read = _JsonReader(), "object", start, start
        elif self.CLOSE is not None and self.num_calls and rest.startswith(self.CLOSE):
            self._buffer, self._state = rest[len(self.CLOSE):], "content"
        else:
            self._state = "content"
        return True

    def _object(self, out: list[Piece]) -> bool:
        """An object without a tool call's head: a tool call all the same once it ends, else content."""
        self._read += self._json.read(self._buffer[self._read:])[1]
        if not (self._json.done or self._json.broken):
            return False
        call = _call_of(self._buffer[self._start:self._read], self.KEYS) if self._json.done else None
        if call is None:
            self._state = "content"
        else:
            out += self._call(call)
            self._buffer, self._state = self._buffer[self._read:], "lead"
        return True

    def finish(self) -> list[Piece]:
        if self._state == "arguments":
            return self._cut()
        rest, self._buffer = self._buffer, ""
        out = self._content(rest) if self._state in ("lead", "object", "content") else []
        return out + self._end()


class Llama3JsonParser(_CallList):
    """Llama 3.x's JSON tool calls: an output that starts (after ``<|python_tag|>``, if the special
    tokens are kept) with ``{"name": ..., "parameters": {...}}`` ("arguments" too), several
    separated by ";". An output that does not start with a tool call is content."""

    FIRST, BETWEEN, CLOSE = ("<|python_tag|>", ""), (";",), None
    KEYS = ("parameters", "arguments")


class _Required(_CallList):
    """The output of ``required_schema``: ``[{"name": ..., "parameters": {...}}, ...]``."""

    FIRST, BETWEEN, CLOSE = ("[",), (",",), "]"
    KEYS = ("parameters",)


class _Named(ToolCallParser):
    """The output of ``named_schema``: the named function's arguments object."""

    def __init__(self, function: str) -> None:
        super().__init__()
        self._function = function

    def _step(self, out: list[Piece]) -> bool:
        if self._buffer and not self.num_calls:
            out += self._begin(self._function)
        if self.num_calls and not (self._json.done or self._json.broken):
            out += self._arguments()
        else:  # text after the arguments object: dropped
            self._buffer = ""
        return False

    def finish(self) -> list[Piece]:
        return self._cut() if self.num_calls and not (self._json.done or self._json.broken) else []


def parse_tool_calls(parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content or None, tool calls) of a whole output."""
    p = ToolCallParser.of(parser)
    content, calls = "", []
    for piece in p.feed(text) + p.finish():
        if isinstance(piece, str):
            content += piece
        elif isinstance(piece, ToolCall):
            calls.append(piece)
        else:
            calls[-1] = ToolCall(calls[-1].name, calls[-1].arguments + piece.text)
    return content or None, calls


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


# ---- one choice's tool calls, streamed or whole -----------------------------------------------


class ChoiceToolCalls:
    """One choice's output read for tool calls, by ``tool_choice``: "auto" (``parser``), "required"
    or "named" (the constrained JSON). ``feed``/``finish`` give OpenAI's stream deltas (content
    or ``tool_calls``: a tool call's first delta has its index, id, type, name and arguments so far;
    the others its index and more arguments); ``message`` the non-streamed message's fields."""

    def __init__(self, tool_choice: str, *, parser: str | None = None, function: str | None = None,
                 parallel: bool = True) -> None:
        assert tool_choice in ("auto", "required", "named")
        self.parallel = parallel
        if tool_choice == "auto":
            self._parser = ToolCallParser.of(parser)
        else:
            self._parser = _Required() if tool_choice == "required" else _Named(function)
        self._kept = False  # whether the tool call being read is answered (parallel_tool_calls false: the first)
        self.num_calls = 0

    def feed(self, text: str) -> list[dict]:
        return self._deltas(self._parser.feed(text))

    def finish(self) -> list[dict]:
        return self._deltas(self._parser.finish())

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

    def _deltas(self, pieces: list[Piece]) -> list[dict]:
        """One delta a piece; a tool call's arguments joined to the delta before them when it is the
        same tool call's."""
        out: list[dict] = []
        for piece in pieces:
            if isinstance(piece, str):
                out.append({"content": piece})
            elif isinstance(piece, ToolCall):
                self._kept = self.parallel or self.num_calls == 0
                if self._kept:
                    out.append({"tool_calls": [{"index": self.num_calls, **piece.as_openai(new_call_id())}]})
                    self.num_calls += 1
            elif self._kept:
                if out and "tool_calls" in out[-1]:
                    out[-1]["tool_calls"][0]["function"]["arguments"] += piece.text
                else:
                    out.append({"tool_calls": [{"index": self.num_calls - 1, "function": {"arguments": piece.text}}]})
        return out
