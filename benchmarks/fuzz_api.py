"""Fuzz the HTTP API with schemathesis, driven by the server's own OpenAPI schema (`/openapi.json`).

Every operation in FUZZED gets schemathesis-generated requests, valid (positive) and invalid (negative)
by the schema, with the API key on each. Every response must be: no 5xx; a non-2xx is an OpenAI-style
JSON error `{"error": {"message", "type", "param", "code"}}` with content-type application/json; a
2xx JSON body parses and an event stream is well-formed `data:` events ending in `[DONE]` with no error
event; each request finishes within TIME_LIMIT_S; plus schemathesis' status-code, content-type and
response-schema conformance checks (JSON bodies). Once the run is over and the server idle, no KV block
is in use.

Generated bodies are made cheap to serve, not narrower (`prepare`): `model` names the served model,
token counts and `n` are capped, and a null or missing token limit becomes MAX_TOKENS.

    python benchmarks/fuzz_api.py --base-url http://127.0.0.1:8000 --api-key k --max-examples 500

Prints requests per operation and status and every failure (with its request as a curl command); exit
status 1 on any failure or leaked block. tests/server/test_fuzz.py runs the same checks in CI: a short
derandomized run (`@schema.parametrize()`, plus the coverage phase on the cheap operations) against a
server of its own.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import hypothesis
import requests
import schemathesis
from hypothesis import HealthCheck, Phase
from hypothesis import strategies as st
from schemathesis import BaseSchema, Case, CheckContext, GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

FUZZED: tuple[tuple[str, str], ...] = (
    ("GET", "/health"),
    ("HEAD", "/health"),
    ("GET", "/v1/models"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/cache/reset"),
    ("POST", "/v1/requests/{request_id}/abort"),
)
TIME_LIMIT_S = 30.0
MAX_TOKENS = 4
CAPS = {"max_tokens": MAX_TOKENS, "max_completion_tokens": MAX_TOKENS, "min_tokens": MAX_TOKENS, "n": 2}
ERROR_FIELDS = {"message", "type", "param", "code"}


def config(max_examples: int, deterministic: bool, coverage: bool = False) -> schemathesis.Config:
    """Schemathesis settings: the fuzzing phase, positive and negative cases, no shrinking (a failure is
    reported as the request that was sent). With ``coverage``, also the coverage phase (boundary values,
    unsupported methods) on every operation but the two generation ones, where it sends ~300 cases each
    (only `@schema.parametrize()` runs that phase; main() below fuzzes)."""
    generation = {
        "mode": "all",
        "max-examples": max_examples,
        "deterministic": deterministic,
        "no-shrink": True,
    }
    data: dict[str, Any] = {
        "phases": {"coverage": {"enabled": coverage}, "stateful": {"enabled": False}},
        "generation": generation,
        # Reports show the request as sent: the default also hides every field named like *token*.
        "output": {
            "sanitization": {"keys-to-sanitize": ["authorization"], "sensitive-markers": ["authorization"]}
        },
        "operations": [
            {"include-path-regex": "^/v1/(chat/)?completions$", "phases": {"coverage": {"enabled": False}}}
        ],
    }
    return schemathesis.Config.from_dict(data)


def fuzzed(schema: BaseSchema) -> BaseSchema:
    """The FUZZED operations of ``schema``; every one of them must be in it."""
    labels = {f"{m.upper()} {p}" for p, methods in schema.raw_schema["paths"].items() for m in methods}
    missing = [f"{m} {p}" for m, p in FUZZED if f"{m} {p}" not in labels]
    assert not missing, f"the schema lacks {missing}"
    # exclude, not include: schemathesis ORs include filters with the one the `operations` config adds
    return schema.exclude(lambda ctx: (ctx.operation.method.upper(), ctx.operation.path) not in FUZZED)


def prepare(case: Case, model: str) -> None:
    """Make a generated request cheap to serve, leaving every generated field in place: a string `model`
    names the served model (any other name is a 404 before anything else is looked at); numbers above
    CAPS are capped (a value below stays, invalid ones included); a token limit of null (none: up to the
    context length) becomes MAX_TOKENS, and a chat request with no limit at all gets one."""
    body = case.body
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str):
        body["model"] = model
    for key, cap in CAPS.items():
        value = body.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > cap:
            body[key] = cap
    path = case.operation.path
    if path == "/v1/completions" and "max_tokens" in body and body["max_tokens"] is None:
        body["max_tokens"] = MAX_TOKENS
    unlimited = body.get("max_tokens") is None and body.get("max_completion_tokens") is None
    if path == "/v1/chat/completions" and unlimited:
        body["max_completion_tokens"] = MAX_TOKENS


def _media_type(headers: Any) -> str:
    values = headers.get("content-type") or [""]
    value = values[0] if isinstance(values, list) else str(values)
    return value.split(";")[0].strip().lower()


def openai_error_shape(ctx: CheckContext, response: schemathesis.Response, case: Case) -> bool | None:
    """A non-2xx is application/json `{"error": {"message": str, "type": str, "param", "code"}}`."""
    if 200 <= response.status_code < 300:
        return None
    media = _media_type(response.headers)
    assert media == "application/json", f"{response.status_code} with content-type {media!r}"
    if case.method.upper() == "HEAD":
        return None  # no body
    try:
        body = json.loads(response.content)
    except ValueError as exc:
        raise AssertionError(f"{response.status_code} body is not JSON: {response.content[:200]!r}") from exc
    assert isinstance(body, dict) and set(body) == {"error"}, f"not an OpenAI error: {body!r}"
    error = body["error"]
    assert isinstance(error, dict) and set(error) == ERROR_FIELDS, f"not an OpenAI error: {body!r}"
    assert isinstance(error["message"], str) and isinstance(error["type"], str), body
    assert all(error[k] is None or isinstance(error[k], str) for k in ("param", "code")), body
    return None


def well_formed_body(ctx: CheckContext, response: schemathesis.Response, case: Case) -> bool | None:
    """A 2xx JSON body parses; an event stream is `data:` JSON events then `data: [DONE]`, no error event."""
    if not 200 <= response.status_code < 300 or case.method.upper() == "HEAD":
        return None
    media = _media_type(response.headers)
    text = response.content.decode("utf-8", errors="replace")
    if media == "application/json":
        try:
            json.loads(text)
        except ValueError as exc:
            raise AssertionError(f"the 2xx body is not JSON: {text[:200]!r}") from exc
    elif media == "text/event-stream":
        events = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
        assert events and events[-1] == "[DONE]", f"the stream does not end in [DONE]: {text[-300:]!r}"
        for event in events[:-1]:
            try:
                chunk = json.loads(event)
            except ValueError as exc:
                raise AssertionError(f"an event is not JSON: {event[:200]!r}") from exc
            assert isinstance(chunk, dict) and "error" not in chunk, f"an error event mid-stream: {event}"
    return None


def json_schema_conformance(ctx: CheckContext, response: schemathesis.Response, case: Case) -> bool | None:
    """Schemathesis' response-schema check, on all but event streams: for Open API 3.1 it reads the
    `text/event-stream` schema (`{"type": "string"}` here) as the schema of each parsed event object,
    which no event meets (well_formed_body checks streams instead)."""
    if _media_type(response.headers) == "text/event-stream":
        return None
    return response_schema_conformance(ctx, response, case)


CHECKS: list[Callable[..., bool | None]] = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    json_schema_conformance,
    openai_error_shape,
    well_formed_body,
]


def send(case: Case, base_url: str, api_key: str | None, model: str) -> tuple[schemathesis.Response, float]:
    """Send ``case``, prepared; -> (response, seconds). AssertionError, naming the request as a curl
    command, when no answer comes within TIME_LIMIT_S or the connection fails."""
    prepare(case, model)
    start = time.monotonic()
    try:
        response = case.call(base_url=base_url, headers=auth(api_key), timeout=TIME_LIMIT_S)
    except requests.RequestException as exc:
        what = f"no response within {TIME_LIMIT_S:.0f} s" if isinstance(exc, requests.Timeout) else repr(exc)
        raise AssertionError(f"{what}: {case.as_curl_command(auth(api_key), base_url=base_url)}") from exc
    return response, time.monotonic() - start


def check(case: Case, response: schemathesis.Response, elapsed: float, api_key: str | None) -> None:
    """Run CHECKS (a schemathesis FailureGroup, with the request as a curl command, if any fails) and
    the time limit on a response to ``case``."""
    case.validate_response(response, checks=CHECKS, headers=auth(api_key))
    if elapsed > TIME_LIMIT_S:
        curl = case.as_curl_command(auth(api_key), base_url=response.request.url)
        raise AssertionError(f"took {elapsed:.1f} s (limit {TIME_LIMIT_S:.0f} s): {curl}")


def call_and_check(case: Case, base_url: str, api_key: str | None, model: str) -> None:
    response, elapsed = send(case, base_url, api_key, model)
    check(case, response, elapsed, api_key)


def auth(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def metrics(base_url: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def kv_blocks_used_once_idle(base_url: str, timeout: float = 10.0) -> float:
    """KV blocks in use once no request runs (0 unless a request leaked its blocks)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(base_url)
        used = sum(v for k, v in m.items() if k.startswith("hybridserve_kv_blocks_used"))
        idle = m.get("hybridserve_num_requests_running") == 0
        if (used == 0 and idle) or time.monotonic() > deadline:
            return used
        time.sleep(0.05)


# ---- the long run -----------------------------------------------------------------------------
@dataclass
class Tally:
    statuses: Counter[tuple[str, str]] = field(default_factory=Counter)  # (operation, status)
    failures: list[tuple[str, str]] = field(default_factory=list)  # (operation, report)
    slowest: tuple[float, str] = (0.0, "")


def fuzz_operation(
    schema: BaseSchema, label: str, args: argparse.Namespace, model: str, tally: Tally
) -> None:
    """``args.max_examples`` generated requests (positive and negative) to one operation; every failure
    is recorded and the run goes on (no shrinking: the report is the request as sent)."""
    method, path = label.split(" ", 1)
    operation = schema[path][method]
    strategy = st.one_of([operation.as_strategy(generation_mode=mode) for mode in GenerationMode])

    @hypothesis.settings(
        max_examples=args.max_examples,
        deadline=None,
        database=None,
        derandomize=args.seed is None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @hypothesis.given(case=strategy)
    def run(case: Case) -> None:
        try:
            response, elapsed = send(case, args.base_url, args.api_key, model)
        except AssertionError as exc:
            tally.statuses[(label, "no response")] += 1
            tally.failures.append((label, str(exc)))
            return
        tally.statuses[(label, str(response.status_code))] += 1
        if elapsed > tally.slowest[0]:
            tally.slowest = (elapsed, f"{label} -> {response.status_code}")
        try:
            check(case, response, elapsed, args.api_key)
        except (FailureGroup, AssertionError) as exc:
            tally.failures.append((label, str(exc)))

    if args.seed is not None:
        run = hypothesis.seed(args.seed)(run)
    run()


def summary(tally: Tally, leaked: float, wall_s: float) -> str:
    lines = [f"{'operation':<40} {'status':>11} {'requests':>9}"]
    by_status: Counter[str] = Counter()
    for (label, status), count in sorted(tally.statuses.items()):
        lines.append(f"{label:<40} {status:>11} {count:>9}")
        by_status[status] += count
    statuses = ", ".join(f"{s}: {c}" for s, c in sorted(by_status.items()))
    lines.append(f"{sum(by_status.values())} requests in {wall_s:.0f} s ({statuses})")
    lines.append(f"slowest: {tally.slowest[0]:.2f} s ({tally.slowest[1]})")
    lines.append(f"KV blocks in use once idle: {leaked:g}")
    lines.append(f"failures: {len(tally.failures)}")
    for label, report in tally.failures:
        lines.append(f"--- {label}\n{report.strip()}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--max-examples", type=int, default=500, help="generated requests per operation")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: derandomized)")
    parser.add_argument("--operation", action="append", help="e.g. 'POST /v1/completions' (default: all)")
    args = parser.parse_args()

    models = httpx.get(f"{args.base_url}/v1/models", headers=auth(args.api_key), timeout=10).json()
    model = models["data"][0]["id"]
    schema = fuzzed(schemathesis.openapi.from_url(f"{args.base_url}/openapi.json", config=config(1, True)))
    labels = args.operation or [f"{m} {p}" for m, p in FUZZED]
    tally = Tally()
    start = time.monotonic()
    for label in labels:
        before = sum(tally.statuses.values())
        fuzz_operation(schema, label, args, model, tally)
        print(f"{label}: {sum(tally.statuses.values()) - before} requests", file=sys.stderr, flush=True)
    wall_s = time.monotonic() - start
    leaked = kv_blocks_used_once_idle(args.base_url)
    print(summary(tally, leaked, wall_s))
    sys.exit(1 if tally.failures or leaked else 0)


if __name__ == "__main__":
    main()
