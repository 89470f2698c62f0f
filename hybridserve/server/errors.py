"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybridserve.engine.errors import (
    EngineDeadError,
    EngineStoppedError,
    HandoffFailedError,
    RequestFailedError,
    RequestRejected,
)

log = logging.getLogger("hybridserve.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def from_engine(exc: BaseException) -> APIError:
    """The HTTP error for an exception raised while serving a request."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestRejected):
        return APIError(400, str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, RequestFailedError):
        return APIError(500, str(exc), code="engine_step_failed")
    if isinstance(exc, HandoffFailedError):
        return APIError(503, str(exc), code="kv_handoff_failed")
    if isinstance(exc, EngineStoppedError):
        return APIError(503, str(exc), code="server_shutting_down")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_failed")
    log.error("unexpected error while serving a request", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}", code="internal_error")


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def _describe(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    if first.get("type") == "extra_forbidden":
        return f"unknown field {param!r}", param
    return f"{param}: {first.get('msg')}" if param else str(first.get("msg")), param


def install_error_handlers(app: FastAPI, on_error: Callable[[int], None] = lambda status: None) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        on_error(exc.status)
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        on_error(400)
        message, param = _describe(exc)
        return error_response(400, message, param, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        return error_response(exc.status_code, message, headers=dict(exc.headers or {}))  # Allow on a 405

    @app.exception_handler(json.JSONDecodeError)
    async def _json(_: Request, exc: json.JSONDecodeError) -> JSONResponse:
        return error_response(400, f"the request body is not valid JSON: {exc.msg}")

    async def _engine(_: Request, exc: Exception) -> JSONResponse:
        error = from_engine(exc)
        on_error(error.status)
        return error_response(error.status, error.message, error.param, error.code, error.headers)

    engine_errors = (RequestRejected, RequestFailedError, HandoffFailedError, EngineStoppedError)
    for engine_error in (*engine_errors, EngineDeadError):
        app.add_exception_handler(engine_error, _engine)
    app.add_exception_handler(Exception, _engine)  # anything else: a JSON 500, logged
