"""Tool calls in DeepSeek's format: the constraint that forces one (``tool_choice`` required or named), and
the parser that turns generated text into OpenAI ``tool_calls``, whole or as streaming deltas.

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{JSON}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>

DeepSeek-V3's older form, ``function<｜tool▁sep｜>NAME\\n```json\\n{JSON}\\n```'', is read too.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from hybridserve.engine.request import StructuredOutputsParams
from hybridserve.server.protocol import (
    ChatCompletionRequest,
    FunctionCallDelta,
    FunctionCallOut,
    NamedToolChoice,
    ToolCallDelta,
    ToolCallOut,
)
from hybridserve.tokenizer import TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_CALLS_BEGIN, TOOL_SEP

_CALL = re.compile(
    re.escape(TOOL_CALL_BEGIN) + "(.*?)" + re.escape(TOOL_SEP) + "(.*?)" + re.escape(TOOL_CALL_END), re.S
)
MAX_JSON_WHITESPACE = 1  # per gap in forced arguments: a weak model must not pad JSON with newlines forever
_V3_ARGS = re.compile(r"^\s*(\S+)\s*```(?:json)?\s*(.*?)\s*```\s*$", re.S)


def tool_constraint(
    body: ChatCompletionRequest, fmt: str = "deepseek_v3_1", reasoning: bool = False, auto: bool = False
) -> StructuredOutputsParams | None:
    """For ``tool_choice`` required or a named function: a structural tag, in xgrammar's ``fmt`` (a model
    name), that admits only valid calls (each call's arguments follow its function's parameters schema);
    with ``auto``, one for ``tool_choice`` auto too (free text, but a call once begun is held to them).
    ``reasoning``: the output starts with reasoning that ``</think>`` ends."""
    choice = body.tool_choice
    forced = choice == "required" or isinstance(choice, NamedToolChoice)
    if not body.tools or not (forced or (auto and choice in (None, "auto"))):
        return None
    tools: list[Any] = [t.model_dump(exclude_none=True) for t in body.tools]
    for t in tools:
        t["function"].setdefault("parameters", {"type": "object"})
    named: Any = choice.model_dump() if isinstance(choice, NamedToolChoice) else choice or "auto"
    import xgrammar as xgr  # here: see engine/sample/structured_outputs.py on why (imported on first use)

    tag = xgr.get_model_structural_tag(
        fmt,
        tools=tools,
        tool_choice=named,
        reasoning="enabled" if reasoning else "disabled",
        parallel_tool_calls=body.parallel_tool_calls,
        max_whitespace_cnt=MAX_JSON_WHITESPACE,
    )
    return StructuredOutputsParams(structural_tag=tag.model_dump_json())


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: str, arguments: str) -> tuple[str, str]:
    """(name, arguments) of one call, in either DeepSeek form; arguments re-serialised when valid JSON."""
    name, arguments = name.strip(), arguments.strip()
    old = _V3_ARGS.match(arguments) if name == "function" else None
    if old is not None:
        name, arguments = old.group(1), old.group(2)
    with contextlib.suppress(ValueError):  # else returned as generated: the client sees what the model wrote
        arguments = json.dumps(json.loads(arguments), ensure_ascii=False)
    return name, arguments


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCallOut]]:
    """(content before the calls or None, the calls) of a whole output."""
    start = text.find(TOOL_CALLS_BEGIN)
    if start < 0:
        return text, []
    calls = [_call(name, args) for name, args in _CALL.findall(text, start)]
    if not calls:  # calls begun but none completed (cut off): no markup in the content
        return text[:start] or None, []
    out = [ToolCallOut(id=new_call_id(), function=FunctionCallOut(name=n, arguments=a)) for n, a in calls]
    return text[:start] or None, out


@dataclass
class StreamingToolParser:
    """Feeds on text deltas; -> (content delta, tool call deltas). Content is held back while it might be
    the start of the calls marker; each call is sent whole (name and arguments) once its end marker came."""

    buffer: str = ""
    in_calls: bool = False
    num_calls: int = 0
    calls: list[ToolCallOut] = field(default_factory=list)

    @property
    def completed(self) -> list[ToolCallOut]:
        return self.calls

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        self.buffer += delta
        content = ""
        if not self.in_calls:
            start = self.buffer.find(TOOL_CALLS_BEGIN)
            if start >= 0:
                content, self.buffer, self.in_calls = self.buffer[:start], self.buffer[start:], True
            else:
                keep = 0 if final else partial_suffix(self.buffer, TOOL_CALLS_BEGIN)
                content, self.buffer = (
                    self.buffer[: len(self.buffer) - keep],
                    self.buffer[len(self.buffer) - keep :],
                )
        calls = self._calls() if self.in_calls else []
        if final:  # what is left of the calls is an unfinished one: never content
            self.buffer = ""
        return content, calls

    def _calls(self) -> list[ToolCallDelta]:
        deltas, last = [], 0
        for m in _CALL.finditer(self.buffer):
            name, arguments = _call(m.group(1), m.group(2))
            call = ToolCallOut(id=new_call_id(), function=FunctionCallOut(name=name, arguments=arguments))
            self.calls.append(call)
            fn = FunctionCallDelta(name=name, arguments=arguments)
            deltas.append(ToolCallDelta(index=self.num_calls, id=call.id, type="function", function=fn))
            self.num_calls += 1
            last = m.end()
        self.buffer = self.buffer[last:]
        return deltas


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
