"""Why the engine refused or failed a request; the server maps each to an HTTP status."""

from __future__ import annotations


class RequestRejected(ValueError):
    """A request that can never be served as asked (too long, bad token ids, duplicate id): a 400."""

    def __init__(self, message: str, code: str = "invalid_prompt", param: str | None = "prompt") -> None:
        super().__init__(message)
        self.code = code
        self.param = param


class RequestFailedError(RuntimeError):
    """The engine step running the request failed; the engine went on without it: a 500."""


class HandoffFailedError(RuntimeError):
    """A decode worker could not take over the request's KV blocks (the prefill worker went away, or no
    room came up in time): the request never ran here and can be retried: a 503."""


class EngineDeadError(RuntimeError):
    """The engine cannot go on (its state may be inconsistent): the process should be restarted."""


class EngineStoppedError(RuntimeError):
    """The engine stopped before the request finished (shutdown past its grace period): a 503."""
