"""A dead rank on an expert-parallel decode side: the request it held fails with a JSON 5xx through the
router within seconds, the side exits non-zero (an orchestrator restarts it), the prefill side keeps no
block for it, the router marks the side down, and takes the restarted side back."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.distributed.faults import KILL
from tests.server.conftest import Server, spawn_server, stop_server, wait_healthy
from tests.server.test_disagg import ENGINE, Router, _choices, _post, _router_thread, _wait_router

DECODE = ("--disaggregation-mode", "decode", "--data-parallel-size", "2", "--enable-expert-parallel", *ENGINE)


def _wait_decode_up(router: Router, decode: Server, up: bool, timeout_s: float = 30) -> None:
    line = f'hybridserve_router_worker_up{{role="decode",url="{decode.url}"}} {float(up)}'
    deadline = time.monotonic() + timeout_s
    while line not in httpx.get(f"{router.url}/metrics").text:
        assert time.monotonic() < deadline, f"the router did not mark {decode.url} {'up' if up else 'down'}"
        time.sleep(0.1)


def test_a_dead_decode_rank_fails_cleanly_and_the_restarted_side_is_taken_back(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    folder = tiny_checkpoint("mixed")
    prefill = spawn_server(folder, "--disaggregation-mode", "prefill", *ENGINE)
    decode = spawn_server(folder, *DECODE, plugins="tests.distributed.faults:kill_on_token")
    servers, router = [prefill, decode], None
    try:
        for s in servers:
            wait_healthy(s, timeout_s=420)
        router = _router_thread([prefill], [decode])
        _wait_router(router)
        body = {"model": prefill.model, "prompt": [5, KILL, 9, 11, 13], "max_tokens": 8, "temperature": 0}
        start = time.monotonic()
        r = _post(router.url, "/v1/completions", body)
        assert r.status_code >= 500 and "error" in r.json(), r.text
        assert decode.process.wait(timeout=15) != 0 and time.monotonic() - start < 20
        _wait_decode_up(router, decode, False)
        prefill.wait_idle(timeout=10)  # released by the router, or expired at --kv-transfer-timeout
        port = int(decode.url.rsplit(":", 1)[1])
        servers[1] = decode = wait_healthy(spawn_server(folder, *DECODE, port=port), timeout_s=420)
        _wait_decode_up(router, decode, True)
        body["prompt"] = [5, 7, 9, 11, 13, 15, 17, 19, 21]
        got = _post(router.url, "/v1/completions", body)
        assert got.status_code == 200, got.text
        assert _choices(got.json()) == _choices(_post(prefill.url, "/v1/completions", body).json())
    finally:
        if router is not None:
            router.stop()
        for s in servers:
            stop_server(s)
