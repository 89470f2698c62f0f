"""The Responses API's objects: the response around its output, and its output items."""

from __future__ import annotations

import time
from typing import Any

from hybridserve.engine.request import RequestOutput
from hybridserve.server.responses_input import ResponsesRequest
from hybridserve.server.serving import usage


def response_shell(base: str, body: ResponsesRequest) -> dict[str, Any]:
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


def finished(
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


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def message_item(item_id: str, text: str | None, status: str = "completed") -> dict[str, Any]:
    content = [text_part(text)] if text is not None else []
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def call_item(
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
