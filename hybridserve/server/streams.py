"""Async plumbing for handlers: merge several request streams, stop when the client disconnects, SSE."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.requests import Request as HTTPRequest

from hybridserve.server.errors import error_body, from_engine

T = TypeVar("T")
_DONE = object()


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators as (index, item); closing this closes (aborts) them all."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
        except Exception as exc:  # handed to the consumer, which re-raises it
            await queue.put((i, exc))
        finally:
            await queue.put((i, _DONE))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t


async def until_disconnected(request: HTTPRequest) -> None:
    """Returns when the client closes the connection (the body has already been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: HTTPRequest, work: Callable[[], Awaitable[T]]) -> T | None:
    """Run ``work``; if the client disconnects first, cancel it (aborting its requests) and return None."""
    task = asyncio.ensure_future(work())
    watch = asyncio.ensure_future(until_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watch):
            if not t.done():
                t.cancel()
    if task in done:
        return task.result()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


async def guarded(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Pass SSE events through; an error mid-stream becomes an OpenAI-style error event and ``[DONE]``
    (the status line has already gone out, so the error must travel in the stream)."""
    try:
        async for event in events:
            yield event
    except Exception as exc:
        error = from_engine(exc)
        yield sse(error_body(error.status, error.message, error.param, error.code))
        yield sse("[DONE]")
    finally:
        await events.aclose()  # type: ignore[attr-defined]


def sse(payload: BaseModel | dict[str, Any] | str) -> str:
    if isinstance(payload, BaseModel):
        data = payload.model_dump_json(exclude_none=False)
    elif isinstance(payload, dict):
        data = json.dumps(payload)
    else:
        data = payload
    return f"data: {data}\n\n"
