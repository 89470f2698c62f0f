"""The Responses API's stream: ``response.created``, then each output item added, its deltas and done,
then ``response.completed`` (or ``response.incomplete``), as server-sent events."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from hybridserve.engine.request import RequestOutput
from hybridserve.server.output_parsers import OutputReading
from hybridserve.server.protocol import FunctionCallOut, ToolCallDelta, ToolCallOut
from hybridserve.server.responses_items import call_item, finished, message_item, reasoning_item, text_part
from hybridserve.server.serving import new_id


@dataclass
class _Item:
    kind: str  # reasoning, message, function_call
    id: str
    text: str = ""  # the reasoning, the message's text or the call's arguments
    call: ToolCallOut | None = None


@dataclass
class ResponseEvents:
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
                done = finished(self.shell, [self._done_item(i) for i in self.items], out, ids, finish)
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
                "part": text_part(""),
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
            events.append(self._event("response.content_part.done", **text, part=text_part(item.text)))
        else:
            events = [self._event("response.function_call_arguments.done", **where, arguments=item.text)]
        return [
            *events,
            self._event("response.output_item.done", output_index=index, item=self._done_item(item)),
        ]

    def _item(self, item: _Item, status: str = "in_progress") -> dict[str, Any]:
        if item.kind == "reasoning":
            return reasoning_item(item.id, item.text, status)
        if item.kind == "message":
            return message_item(item.id, item.text if status == "completed" else None, status)
        assert item.call is not None
        return call_item(item.id, item.call.id, item.call.function.name, item.text, status)

    def _done_item(self, item: _Item) -> dict[str, Any]:
        return self._item(item, "completed")

    def _event(self, kind: str, **fields: Any) -> str:
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': self.seq, **fields})}\n\n"
