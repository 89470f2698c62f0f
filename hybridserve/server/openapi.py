"""What the OpenAPI schema says each endpoint can answer: errors and the event stream."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

_WHY = {
    400: "invalid request: a field outside its domain, a prompt that can never fit, bad JSON",
    401: "missing or invalid API key",
    404: "no such model (code model_not_found), or no such request to abort",
    413: "request body larger than --max-body-bytes",
    415: "a POST that a browser could send cross-site: send Content-Type: application/json",
    429: "the queue is full; retry after Retry-After seconds",
    500: "the engine step serving the request failed (the engine went on)",
    502: "the router's worker failed or answered out of protocol",
    503: "the engine is loading, shutting down or failed",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for the given error statuses, each an OpenAI-style JSON error."""
    return {s: {"model": ErrorResponse, "description": _WHY[s]} for s in statuses}


_EVENT_STREAM = {
    "description": "the response object, or with `stream: true` server-sent events: one chunk object per "
    "`data:` line, then `data: [DONE]` (an error mid-stream arrives as a `data:` error object first)",
    "content": {"text/event-stream": {"schema": {"type": "string"}}},
}

GENERATE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: _EVENT_STREAM,
    **responses(400, 401, 404, 413, 415, 429, 500, 503),
}

TOKENIZE_RESPONSES: dict[int | str, dict[str, Any]] = responses(400, 401, 404, 413, 415, 503)

# The router answers what its workers answer, and 502 when one fails (a 503 when none is up).
ROUTER_GENERATE_RESPONSES: dict[int | str, dict[str, Any]] = {
    **GENERATE_RESPONSES,
    **responses(502),
}
