"""Request limits: oversize bodies (413, ASGI middleware) and POSTs a browser could send cross-site."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from hybridserve.server.errors import APIError, error_body

Message = dict[str, Any]


class BodySizeLimit:
    """Reads the body up to ``max_bytes`` before the app sees it; more is refused with 413."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message: Message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before sending its body
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._refuse(send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # later reads only wait for the disconnect

        await self.app(scope, replay, send)

    async def _refuse(self, send: Any) -> None:
        await _send_error(send, 413, f"request body is larger than {self.max_bytes:,} bytes")


# What a browser sends cross-site without a CORS preflight ("simple requests").
_SIMPLE_TYPES = {b"", b"text/plain", b"application/x-www-form-urlencoded", b"multipart/form-data"}


def could_be_cross_site_without_preflight(method: str, content_type: str, has_authorization: bool) -> bool:
    """True for a state-changing request a web page on another site could send with no CORS preflight:
    a POST with no JSON content type and no Authorization header. Anything else needs a preflight,
    which this server never grants, so a page on another site cannot drive it."""
    mime = content_type.split(";")[0].strip().lower().encode()
    return method in ("POST", "PUT", "PATCH", "DELETE") and mime in _SIMPLE_TYPES and not has_authorization


def refuse_cross_site(request: Request) -> None:
    """415 for a POST a page on another site could send (see ``could_be_cross_site_without_preflight``);
    the server and the router both guard their POSTs with it."""
    content_type = request.headers.get("content-type", "")
    if could_be_cross_site_without_preflight(
        request.method, content_type, "authorization" in request.headers
    ):
        raise APIError(415, "send Content-Type: application/json (or an Authorization header)")


async def _send_error(send: Any, status: int, message: str) -> None:
    body = json.dumps(error_body(status, message)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
