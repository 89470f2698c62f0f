"""The router's health checks: a dead or failing worker goes down at once, a slow one only after
``failures`` checks in a row time out, and any answer of 200 takes it back."""

from __future__ import annotations

import asyncio

import httpx

from hybridserve.router.workers import Worker, check


def _client(answer: str) -> httpx.AsyncClient:
    def handle(request: httpx.Request) -> httpx.Response:
        if answer == "slow":
            raise httpx.ReadTimeout("slow", request=request)
        if answer == "refused":
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200 if answer == "ok" else 503)

    return httpx.AsyncClient(transport=httpx.MockTransport(handle))


def _run(worker: Worker, answers: list[str], failures: int) -> list[bool]:
    async def go() -> list[bool]:
        ups = []
        for answer in answers:
            async with _client(answer) as client:
                await check(client, worker, 1.0, failures)
            ups.append(worker.up)
        return ups

    return asyncio.run(go())


def test_a_slow_worker_goes_down_after_failures_timeouts_in_a_row() -> None:
    assert _run(Worker("http://w", "decode"), ["slow", "slow", "ok", "slow", "slow", "slow"], 3) == [
        True,
        True,
        True,
        True,
        True,
        False,
    ]


def test_a_refused_or_failing_worker_goes_down_at_once_and_200_takes_it_back() -> None:
    worker = Worker("http://w", "prefill")
    assert _run(worker, ["refused", "ok", "unhealthy", "ok"], 3) == [False, True, False, True]
    assert worker.down_event.is_set() is False


def test_a_slow_worker_stays_down_until_it_answers_in_time() -> None:
    worker = Worker("http://w", "decode")
    assert _run(worker, ["slow", "slow", "slow", "ok"], 2) == [True, False, False, True]
