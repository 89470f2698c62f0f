"""``--tool-call-parser deepseek_v4``: DSML tool calls (see ``chat_format.dsml``) read as they are written.

A call's name goes out as soon as its ``invoke`` tag is complete, then its arguments as JSON in pieces: a
string value streams as it is generated, any other value (``string="false"``) when it is complete. The
pieces of a call join to a JSON object, the same text a whole output is parsed to. A call cut off (by
max_tokens) is not returned in a whole output, and no DSML is ever left in the content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from hybridserve.chat_format.dsml import (
    CALLS_BEGIN,
    CALLS_END,
    INVOKE_BEGIN,
    INVOKE_END,
    PARAM_BEGIN,
    PARAM_END,
)
from hybridserve.server.protocol import FunctionCallDelta, FunctionCallOut, ToolCallDelta, ToolCallOut
from hybridserve.server.tool_calls import new_call_id, partial_suffix

_HEAD = re.compile(r'(.*?)" string="(true|false)">', re.S)
_MAX_HEAD = 1024  # characters of a name or parameter head before it is taken for garbage
_WHITE = " \t\r\n"


@dataclass
class _Call:
    id: str
    name: str
    arguments: str = ""
    done: bool = False


@dataclass
class DsmlToolParser:
    """Feeds on text deltas; -> (content delta, tool call deltas)."""

    buffer: str = ""
    state: str = "text"  # text, calls, name, args, head, value
    calls: list[_Call] = field(default_factory=list)
    is_string: bool = True  # of the parameter being read
    num_params: int = 0  # of the call being read
    _deltas: list[ToolCallDelta] = field(default_factory=list)

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        self.buffer += delta
        content, self._deltas = "", []
        steps: dict[str, Callable[[bool], str | None]] = {
            "text": self._text,
            "calls": self._calls,
            "name": self._name,
            "args": self._args,
            "head": self._head,
            "value": self._value,
        }
        while True:
            out = steps[self.state](final)
            if out is None:
                break
            content += out
        return content, self._deltas

    @property
    def completed(self) -> list[ToolCallOut]:
        return [
            ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
            for c in self.calls
            if c.done
        ]

    # Each step consumes what it can and returns the content it produced, or None to wait for more text.
    def _text(self, final: bool) -> str | None:
        start = self.buffer.find(CALLS_BEGIN)
        if start >= 0:
            content = self.buffer[:start].rstrip(_WHITE)  # the blank line before the block is the format's
            self.buffer, self.state = self.buffer[start + len(CALLS_BEGIN) :], "calls"
            return content
        marker = partial_suffix(self.buffer, CALLS_BEGIN)  # and the blank line that may go before it
        keep = marker + _trailing_white(self.buffer[: len(self.buffer) - marker])
        if final:  # the start of a block cut off is dropped; plain text ending in "<" is not
            keep = keep if marker > 1 else 0
        cut = len(self.buffer) - keep
        content, self.buffer = self.buffer[:cut], "" if final else self.buffer[cut:]
        return content or None

    def _calls(self, final: bool) -> str | None:
        found = self._expect((INVOKE_BEGIN, CALLS_END), final)
        if found == INVOKE_BEGIN:
            self.state = "name"
        elif found == CALLS_END:
            self.state = "text"
        return None if found is None else ""

    def _name(self, final: bool) -> str | None:
        end = self.buffer.find('">')
        if end < 0:
            if len(self.buffer) > _MAX_HEAD:
                self.buffer, self.state = "", "calls"
                return ""
            return None
        call = _Call(new_call_id(), self.buffer[:end])
        self.calls.append(call)
        self.buffer, self.state, self.num_params = self.buffer[end + 2 :], "args", 0
        fn = FunctionCallDelta(name=call.name, arguments="")
        self._deltas.append(
            ToolCallDelta(index=len(self.calls) - 1, id=call.id, type="function", function=fn)
        )
        return ""

    def _args(self, final: bool) -> str | None:
        found = self._expect((PARAM_BEGIN, INVOKE_END), final)
        if found == PARAM_BEGIN:
            self.state = "head"
        elif found == INVOKE_END:
            self._emit("}" if self.num_params else "{}")
            self.calls[-1].done, self.state = True, "calls"
        return None if found is None else ""

    def _head(self, final: bool) -> str | None:
        m = _HEAD.match(self.buffer)
        if m is None:
            if len(self.buffer) > _MAX_HEAD or (final and self.buffer):
                self.buffer, self.state = "", "args"
                return ""
            return None
        key, self.is_string = m.group(1), m.group(2) == "true"
        sep = ", " if self.num_params else "{"
        self._emit(sep + json.dumps(key, ensure_ascii=False) + ": " + ('"' if self.is_string else ""))
        self.buffer, self.state, self.num_params = self.buffer[m.end() :], "value", self.num_params + 1
        return ""

    def _value(self, final: bool) -> str | None:
        end = self.buffer.find(PARAM_END)
        if end < 0:
            if self.is_string:
                keep = partial_suffix(self.buffer, PARAM_END)
                text, self.buffer = (
                    self.buffer[: len(self.buffer) - keep],
                    self.buffer[len(self.buffer) - keep :],
                )
                self._emit(json.dumps(text, ensure_ascii=False)[1:-1] if text else "")
            return None
        value, self.buffer, self.state = self.buffer[:end], self.buffer[end + len(PARAM_END) :], "args"
        self._emit(
            json.dumps(value, ensure_ascii=False)[1:-1] + '"' if self.is_string else _json_value(value)
        )
        return ""

    def _expect(self, tags: tuple[str, ...], final: bool) -> str | None:
        """The tag the buffer starts with (whitespace and stray text before it skipped), or None to wait."""
        while True:
            self.buffer = self.buffer.lstrip(_WHITE)
            tag = next((t for t in tags if self.buffer.startswith(t)), None)
            if tag is not None:
                self.buffer = self.buffer[len(tag) :]
                return tag
            if not self.buffer or (not final and any(t.startswith(self.buffer) for t in tags)):
                return None
            self.buffer = self.buffer[1:]  # not DSML: the model strayed; the text is dropped

    def _emit(self, text: str) -> None:
        if text:
            self.calls[-1].arguments += text
            fn = FunctionCallDelta(arguments=text)
            self._deltas.append(ToolCallDelta(index=len(self.calls) - 1, function=fn))


def _json_value(text: str) -> str:
    """A ``string="false"`` value as JSON; one that is not valid JSON is passed on as a string."""
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except ValueError:
        return json.dumps(text, ensure_ascii=False)


def _trailing_white(text: str) -> int:
    return len(text) - len(text.rstrip(_WHITE))


def parse_dsml(text: str) -> tuple[str | None, list[ToolCallOut]]:
    """(content or None, the completed calls) of a whole output."""
    parser = DsmlToolParser()
    content, _ = parser.feed(text, final=True)
    calls = parser.completed
    return (content or None) if parser.calls else content, calls
