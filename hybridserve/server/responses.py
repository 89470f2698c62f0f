"""POST /v1/responses: OpenAI's Responses API over the chat machinery (one choice; nothing stored).

Output items: a ``reasoning`` item (with a reasoning parser), a ``message`` with ``output_text``, and a
``function_call`` per tool call. Streamed, each item is added, filled by deltas and done, in that order.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import Request as HTTPRequest

from hybridserve.engine.async_llm import AsyncLLM
from hybridserve.engine.request import RequestOutput
from hybridserve.server.chat import output_reading, render_prompt, with_tool_constraint
from hybridserve.server.chat_prompt import v4_efforts
from hybridserve.server.output_parsers import OutputReading
from hybridserve.server.protocol import ChatCompletionRequest, FunctionCallOut, ToolCallDelta, ToolCallOut
from hybridserve.server.responses_input import ResponsesRequest, to_chat
from hybridserve.server.serving import (
    ServerSettings,
    check_model,
    final_outputs,
    new_id,
    sampling_params,
    start,
    usage,
)
from hybridserve.server.streams import guarded


async def create_response(
    body: ResponsesRequest, raw: HTTPRequest, llm: AsyncLLM, settings: ServerSettings
) -> Response:
    check_model(body, settings)
    chat = to_chat(body, v4_efforts(llm))
    ids, prompt = await render_prompt(chat, llm, settings)
    reading = output_reading(chat, llm, settings, prompt)
    params = with_tool_constraint(chat, sampling_params(chat, settings, chat.max_tokens, None), reading)
    base = new_id("resp")
    _, outputs = await start(llm, settings, base, [ids], params, 1, [prompt], chat)
    shell = _shell(base, body, chat)
    if body.stream:
        events = _Events(shell, reading)
        return StreamingResponse(guarded(events.run(outputs, ids)), media_type="text/event-stream")
    finals = await final_outputs(raw, outputs, 1)
    if finals is None:
        return Response(status_code=499)  # the client went away; its request was aborted
    out = finals[0].outputs[0]
    reasoning, content, calls = reading.whole(out.text)
    items = [_reasoning_item(new_id("rs"), reasoning)] if reasoning else []
    items += [_message_item(new_id("msg"), content)] if content else []
    items += [_call_item(new_id("fc"), c.id, c.function.name, c.function.arguments) for c in calls]
    return JSONResponse(_finished(shell, items, finals[0], ids, out.finish_reason))


def _shell(base: str, body: ResponsesRequest, chat: ChatCompletionRequest) -> dict[str, Any]:
    """The response object around its output (as it is while in progress)."""
    return {
        "id": base,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "model": body.model,
        "output": [],
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tools": body.tools or [],
        "tool_choice": body.tool_choice or "auto",
        "parallel_tool_calls": body.parallel_tool_calls,
        "reasoning": body.reasoning,
        "store": False,
        "metadata": body.metadata or {},
        "previous_response_id": None,
        "text": {"format": {"type": "text"}},
        "error": None,
        "incomplete_details": None,
        "usage": None,
    }


def _finished(
    shell: dict[str, Any],
    items: list[dict[str, Any]],
    final: RequestOutput,
    ids: list[int],
    finish: str | None,
) -> dict[str, Any]:
    u = usage([ids], [final], 1)
    cut = finish == "length"
    return {
        **shell,
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "output": items,
        "usage": {
            "input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": final.num_cached_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.total_tokens,
        },
    }


def _reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def _message_item(item_id: str, text: str | None, status: str = "completed") -> dict[str, Any]:
    content = [_text_part(text)] if text is not None else []
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def _call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


@dataclass
class _Item:
    kind: str  # reasoning, message, function_call
    id: str
    text: str = ""  # the reasoning, the message's text or the call's arguments
    call: ToolCallOut | None = None


@dataclass
class _Events:
    """The stream: response.created, then each output item added, its deltas and done, then
    response.completed (or response.incomplete)."""

    shell: dict[str, Any]
    reading: OutputReading
    items: list[_Item] = field(default_factory=list)
    open: _Item | None = None
    seq: int = 0

    async def run(
        self, outputs: AsyncIterator[tuple[int, RequestOutput]], ids: list[int]
    ) -> AsyncIterator[str]:
        parser = self.reading.stream_parser()
        yield self._event("response.created", response=self.shell)
        yield self._event("response.in_progress", response=self.shell)
        async for _, out in outputs:
            finish = out.outputs[0].finish_reason
            reasoning, content, calls = parser.feed(out.new_text, final=out.finished)
            for event in [*self._text("reasoning", reasoning), *self._text("message", content)]:
                yield event
            for event in self._calls(calls):
                yield event
            if out.finished:
                for event in self._close():
                    yield event
                done = _finished(self.shell, [self._done_item(i) for i in self.items], out, ids, finish)
                kind = "response.incomplete" if done["status"] == "incomplete" else "response.completed"
                yield self._event(kind, response=done)

    def _text(self, kind: str, text: str) -> list[str]:
        if not text:
            return []
        events = [] if self.open is not None and self.open.kind == kind else self._start(kind)
        assert self.open is not None
        self.open.text += text
        where = {"item_id": self.open.id, "output_index": len(self.items) - 1, "content_index": 0}
        delta = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        return [*events, self._event(delta, **where, delta=text, **extra)]

    def _calls(self, deltas: list[ToolCallDelta]) -> list[str]:
        events: list[str] = []
        for d in deltas:
            if d.id is not None:  # a new call: its name
                events += self._start("function_call", d)
            assert self.open is not None and self.open.call is not None
            piece = d.function.arguments or ""
            if piece:
                self.open.text += piece
                where = {"item_id": self.open.id, "output_index": len(self.items) - 1}
                events.append(self._event("response.function_call_arguments.delta", **where, delta=piece))
        return events

    def _start(self, kind: str, call: ToolCallDelta | None = None) -> list[str]:
        events = self._close()
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        out = None
        if call is not None:
            fn = FunctionCallOut(name=call.function.name or "", arguments="")
            out = ToolCallOut(id=call.id or "", function=fn)
        self.open = _Item(kind, new_id(prefix), call=out)
        self.items.append(self.open)
        index = len(self.items) - 1
        events.append(
            self._event("response.output_item.added", output_index=index, item=self._item(self.open))
        )
        if kind == "message":
            part = {
                "item_id": self.open.id,
                "output_index": index,
                "content_index": 0,
                "part": _text_part(""),
            }
            events.append(self._event("response.content_part.added", **part))
        return events

    def _close(self) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.items.index(item)
        where = {"item_id": item.id, "output_index": index}
        if item.kind == "reasoning":
            events = [self._event("response.reasoning_text.done", **where, content_index=0, text=item.text)]
        elif item.kind == "message":
            text = {**where, "content_index": 0}
            events = [self._event("response.output_text.done", **text, text=item.text, logprobs=[])]
            events.append(self._event("response.content_part.done", **text, part=_text_part(item.text)))
        else:
            events = [self._event("response.function_call_arguments.done", **where, arguments=item.text)]
        return [
            *events,
            self._event("response.output_item.done", output_index=index, item=self._done_item(item)),
        ]

    def _item(self, item: _Item, status: str = "in_progress") -> dict[str, Any]:
        if item.kind == "reasoning":
            return _reasoning_item(item.id, item.text, status)
        if item.kind == "message":
            return _message_item(item.id, item.text if status == "completed" else None, status)
        assert item.call is not None
        return _call_item(item.id, item.call.id, item.call.function.name, item.text, status)

    def _done_item(self, item: _Item) -> dict[str, Any]:
        return self._item(item, "completed")

    def _event(self, kind: str, **fields: Any) -> str:
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': self.seq, **fields})}\n\n"
