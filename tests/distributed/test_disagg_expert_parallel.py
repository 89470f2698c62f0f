"""Disaggregation x expert parallelism: a prefill side and a decode side of 2 expert-parallel ranks each
(and 2 prefill ranks handing to one decode engine), behind ``hybridserve router``.

Reference: one engine-core process with the same engine flags (the 1-rank server below: requests without
``kv_transfer_params`` run co-located on it, and it is the "1" decode side of the 2 + 1 shape). Greedy
completions through the router equal it token for token, with requests of very different lengths in
flight at once (one rank idles while another works); both prefill ranks really hand off; every block is
back in the pools afterwards.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from hybridserve.bench.server_process import parse_metrics
from hybridserve.config import EngineConfig
from tests.server.conftest import Server, spawn_server, wait_healthy
from tests.server.disagg_faults import CORRUPT_TOKENS
from tests.server.test_disagg import ENGINE, Router, _choices, _post, _router_thread, _wait_router

pytestmark = pytest.mark.slow_file(seconds=45)  # scheduled first: never the run's tail

EXPERT_PARALLEL = ("--data-parallel-size", "2", "--enable-expert-parallel")


@dataclass
class Sides:
    prefill: Server  # 2 expert-parallel ranks
    decode: Server  # 2 expert-parallel ranks
    single: Server  # one engine core: the reference, and a 1-rank decode side
    routers: dict[str, Router]  # "2x2", "2x1" (prefill ranks x decode ranks)


def _stop(servers: list[Server]) -> None:
    for s in servers:
        if s.process.poll() is None:
            s.process.send_signal(signal.SIGTERM)
    for s in servers:
        try:
            s.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            s.process.kill()
            s.process.wait()


@pytest.fixture(scope="module")
def sides(tiny_checkpoint: Callable[[str], Path]) -> Iterator[Sides]:
    folder = tiny_checkpoint("mixed")
    prefill = spawn_server(
        folder, "--disaggregation-mode", "prefill", *EXPERT_PARALLEL, *ENGINE,
        plugins="tests.server.disagg_faults:corrupt_transfer",
    )  # fmt: skip
    decode = spawn_server(folder, "--disaggregation-mode", "decode", *EXPERT_PARALLEL, *ENGINE)
    single = spawn_server(folder, "--disaggregation-mode", "decode", *ENGINE)
    servers = [prefill, decode, single]
    routers: dict[str, Router] = {}
    try:
        for s in servers:
            wait_healthy(s, timeout_s=420)
        routers = {"2x2": _router_thread([prefill], [decode]), "2x1": _router_thread([prefill], [single])}
        for r in routers.values():
            _wait_router(r)
        yield Sides(prefill, decode, single, routers)
    finally:
        for r in routers.values():
            r.stop()
        _stop(servers)


def _bodies(model: str) -> list[tuple[str, dict[str, Any]]]:
    """Prompts across block, window and compressed-row boundaries, short and long outputs, n = 2, chat."""
    out = []
    for k, (n, max_tokens) in enumerate(((3, 24), (40, 4), (17, 16), (9, 2), (33, 20), (5, 8))):
        prompt = [(7 * i + k) % 300 + 5 for i in range(n)]
        body = {"model": model, "prompt": prompt, "temperature": 0, "max_tokens": max_tokens}
        out.append(("/v1/completions", body))
    greedy = {"model": model, "temperature": 0, "max_tokens": 10}
    out.append(("/v1/completions", dict(greedy, prompt="It is a truth universally acknowledged", n=2)))
    out.append(("/v1/chat/completions", dict(greedy, messages=[{"role": "user", "content": "Hello there"}])))
    return out


def _all_at_once(url: str, bodies: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    with ThreadPoolExecutor(len(bodies)) as pool:
        responses = list(pool.map(lambda b: _post(url, *b), bodies))
    for r in responses:
        assert r.status_code == 200, r.text
    return [_choices(r.json()) for r in responses]


@pytest.mark.parametrize("shape", ["2x2", "2x1"])
def test_disaggregated_expert_parallel_equals_one_process(sides: Sides, shape: str) -> None:
    bodies = _bodies(sides.single.model)
    reference = [_choices(_post(sides.single.url, *b).json()) for b in bodies]
    assert _all_at_once(sides.routers[shape].url, bodies) == reference
    for s in (sides.prefill, sides.decode, sides.single):
        s.wait_idle(timeout=15)
    routed = parse_metrics(httpx.get(f"{sides.routers[shape].url}/metrics").text)
    moved = {k: v for k, v in routed.items() if k.startswith("hybridserve_router_handoff_bytes_total")}
    assert moved and all(v > 0 for v in moved.values()), routed  # every group, as the router saw it
    sides_with_ranks = [sides.prefill, sides.decode] if shape == "2x2" else [sides.prefill]
    for side in sides_with_ranks:  # every rank of each 2-rank side handed off
        done = {k: v for k, v in side.metrics().items() if "dp_rank_kv_handoff_transfers" in k}
        assert len(done) == 2 and all(v > 0 for v in done.values()), done


def test_a_corrupted_handoff_fails_its_request_cleanly_and_is_counted(sides: Sides) -> None:
    """One byte changes on the way from a prefill rank: the decode rank checks every group's checksum
    before the request runs, fails it with a JSON error, frees its blocks and serves the next request."""
    body = {"model": sides.single.model, "prompt": list(range(10, 10 + CORRUPT_TOKENS)), "max_tokens": 5}
    body["temperature"] = 0
    answer = _post(
        sides.prefill.url, "/v1/completions", dict(body, kv_transfer_params={"do_remote_decode": True})
    )
    assert answer.status_code == 200, answer.text
    params = answer.json()["kv_transfer_params"]
    r = _post(sides.decode.url, "/v1/completions", dict(body, kv_transfer_params=params))
    assert r.status_code >= 500 and "corrupted" in r.json()["error"]["message"], r.text
    assert sides.decode.metrics()["hybridserve_kv_handoff_corrupt_total"] == 1
    for s in (sides.prefill, sides.decode):
        s.wait_idle(timeout=15)
    body["prompt"] = body["prompt"][:-1]  # the same pair goes on
    assert _choices(_post(sides.routers["2x2"].url, "/v1/completions", body).json()) == _choices(
        _post(sides.single.url, "/v1/completions", body).json()
    )


def test_blocks_no_decode_rank_will_pull_are_released_on_every_prefill_rank(sides: Sides) -> None:
    """The router's ``/v1/kv/release`` (a request that ended before its pull) reaches the rank holding each
    handle, long before the handoff timeout would free them."""
    prompts = [[(3 * i + k) % 250 + 5 for i in range(20 + k)] for k in range(4)]  # both ranks hold some
    bodies = [
        ("/v1/completions", {"model": sides.single.model, "prompt": p, "max_tokens": 4, "temperature": 0,
                             "kv_transfer_params": {"do_remote_decode": True}})
        for p in prompts
    ]  # fmt: skip
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda b: _post(sides.prefill.url, *b), bodies))
    handles = [e["handoff"]["handle"] for a in answers for e in a.json()["kv_transfer_params"]["requests"]]
    assert len(handles) == len(prompts) and sides.prefill.kv_blocks_used() > 0
    released = _post(sides.prefill.url, "/v1/kv/release", {"handles": handles})
    assert released.status_code == 200, released.text
    sides.prefill.wait_idle(timeout=3)  # the handoff timeout is 5 s
    assert sides.prefill.metrics()["hybridserve_kv_handoff_expired_total"] == 0


def test_each_rank_of_a_side_gets_its_own_bootstrap_port() -> None:
    ports = [
        EngineConfig(
            disaggregation_mode="prefill", data_parallel_size=2, data_parallel_rank=r,
            disaggregation_bootstrap_port=29600, enforce_eager=True,
        ).rank_bootstrap_port
        for r in (0, 1)
    ]  # fmt: skip
    assert ports == [29600, 29601]
    assert (
        EngineConfig(
            disaggregation_mode="decode", data_parallel_size=2, enforce_eager=True
        ).rank_bootstrap_port
        == 0
    )
