"""Schemathesis fuzzing of the HTTP API (the checks of benchmarks/fuzz_api.py, short and derandomized):
generated requests, valid and invalid by the OpenAPI schema, to every operation in FUZZED; no 5xx, every
non-2xx an OpenAI-style JSON error, no request slower than TIME_LIMIT_S, and no KV block left in use.

The schema is the app's own, built in-process at import (``@schema.parametrize()`` needs it at
collection, before the server runs); the first test checks that the server serves exactly it."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.core.failures import FailureGroup

from benchmarks.fuzz_api import call_and_check, config, fuzzed
from hybridserve.config import EngineConfig
from hybridserve.server.openai_api import build_app
from hybridserve.server.serving import ServerSettings
from tests.server.conftest import API_KEY, Server, start_server, stop_server

MODEL = "fuzz-model"
MAX_EXAMPLES = 50  # per operation; those without inputs exhaust theirs in one request

OPENAPI = build_app(
    EngineConfig(model="unused", enforce_eager=True), ServerSettings(model_name=MODEL)
).openapi()
schema = fuzzed(
    schemathesis.openapi.from_dict(OPENAPI, config=config(MAX_EXAMPLES, deterministic=True, coverage=True))
)


@dataclass
class LoggedServer(Server):
    log: deque[str] = field(default_factory=lambda: deque(maxlen=400), repr=False)

    def log_tail(self, lines: int = 60) -> str:
        return "".join(list(self.log)[-lines:])


def _drain(server: LoggedServer) -> None:
    assert server.process.stdout is not None
    for line in server.process.stdout:
        server.log.append(line)


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Callable[[str], Path]) -> Iterator[LoggedServer]:
    """Overrides the package's ``server``, so its autouse check that KV blocks go back to 0 runs after
    each operation's fuzzing too. The server log is read as it comes (tracebacks go into failures)."""
    started = start_server(
        tiny_checkpoint("mixed"),
        "--api-key",
        API_KEY,
        "--served-model-name",
        MODEL,
        "--max-num-batched-tokens",
        "64",
        "--max-num-seqs",
        "8",
        "--max-queue",
        "64",
    )
    s = LoggedServer(started.url, started.model, started.folder, started.process)
    reader = threading.Thread(target=_drain, args=(s,), daemon=True)
    reader.start()
    yield s
    s.wait_idle()
    assert stop_server(s) == 0, s.log_tail()
    reader.join(timeout=5)
    assert "Traceback" not in "".join(s.log), s.log_tail(200)


def _without_operation_ids(schema: dict[str, Any]) -> dict[str, Any]:
    # GET and HEAD /health share one FastAPI route, so one operationId, named after whichever method a
    # set yields first: it differs between processes (string hashing).
    paths = {
        path: {method: {k: v for k, v in op.items() if k != "operationId"} for method, op in methods.items()}
        for path, methods in schema["paths"].items()
    }
    return {**schema, "paths": paths}


def test_the_server_serves_the_fuzzed_schema(server: LoggedServer) -> None:
    served = httpx.get(f"{server.url}/openapi.json", timeout=10).json()
    assert _without_operation_ids(served) == _without_operation_ids(OPENAPI)


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), print_blob=False)
def test_fuzz(case: schemathesis.Case, server: LoggedServer) -> None:
    try:
        call_and_check(case, server.url, API_KEY, MODEL)
    except (AssertionError, FailureGroup) as exc:
        raise AssertionError(f"{exc}\n--- server log (tail) ---\n{server.log_tail()}") from None
