"""A dead rank on an expert-parallel side, prefill or decode: the request it held fails with a JSON 5xx
through the router within seconds, the side exits non-zero (an orchestrator restarts it), the other side
keeps no block for it, the router marks the side down, and takes the restarted side back."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.distributed.faults import KILL
from tests.server.conftest import Server, spawn_server, stop_server, wait_healthy
from tests.server.test_disagg import ENGINE, Router, _choices, _post, _router_thread, _wait_router

pytestmark = pytest.mark.slow_file(seconds=70)  # scheduled first: never the run's tail

EXPERT_PARALLEL = ("--data-parallel-size", "2", "--enable-expert-parallel")


def _wait_up(router: Router, role: str, worker: Server, up: bool, timeout_s: float = 30) -> None:
    line = f'hybridserve_router_worker_up{{role="{role}",url="{worker.url}"}} {float(up)}'
    deadline = time.monotonic() + timeout_s
    while line not in httpx.get(f"{router.url}/metrics").text:
        assert time.monotonic() < deadline, f"the router did not mark {worker.url} {'up' if up else 'down'}"
        time.sleep(0.1)


def _flags(role: str, dying: str) -> tuple[str, ...]:
    ranks = EXPERT_PARALLEL if role == dying else ()
    return ("--disaggregation-mode", role, *ranks, *ENGINE)


@pytest.mark.parametrize("dying", ["prefill", "decode"])
def test_a_dead_rank_fails_cleanly_and_the_restarted_side_is_taken_back(
    tiny_checkpoint: Callable[[str], Path], dying: str
) -> None:
    folder = tiny_checkpoint("mixed")
    kill = "tests.distributed.faults:kill_on_token"
    sides = {
        role: spawn_server(folder, *_flags(role, dying), plugins=kill if role == dying else "")
        for role in ("prefill", "decode")
    }
    router = None
    try:
        for s in sides.values():
            wait_healthy(s, timeout_s=420)
        router = _router_thread([sides["prefill"]], [sides["decode"]])
        _wait_router(router)
        victim, survivor = sides[dying], sides["decode" if dying == "prefill" else "prefill"]
        body = {"model": victim.model, "prompt": [5, KILL, 9, 11, 13], "max_tokens": 8, "temperature": 0}
        start = time.monotonic()
        r = _post(router.url, "/v1/completions", body)
        assert r.status_code >= 500 and "error" in r.json(), r.text
        assert victim.process.wait(timeout=15) != 0 and time.monotonic() - start < 20
        _wait_up(router, dying, victim, False)
        survivor.wait_idle(timeout=10)  # released by the router, or expired at --kv-transfer-timeout
        port = int(victim.url.rsplit(":", 1)[1])
        sides[dying] = victim = wait_healthy(spawn_server(folder, *_flags(dying, dying), port=port), 420)
        _wait_up(router, dying, victim, True)
        body["prompt"] = [5, 7, 9, 11, 13, 15, 17, 19, 21]
        got = _post(router.url, "/v1/completions", body)
        assert got.status_code == 200, got.text  # the single-rank side serves co-located: the reference
        assert _choices(got.json()) == _choices(_post(survivor.url, "/v1/completions", body).json())
    finally:
        if router is not None:
            router.stop()
        for s in sides.values():
            stop_server(s)
