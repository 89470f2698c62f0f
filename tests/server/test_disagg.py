"""Prefill/decode disaggregation end to end: a router, prefill and decode worker processes (gloo handoff).

Reference: the package's co-located server (same model and engine flags). Greedy and seeded completions
through the router equal it token for token; workers that die fail their requests with a JSON 5xx and
leave no block allocated on the survivors; the router takes a restarted worker back.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from hybridserve.router.app import RouterSettings, build_router_app
from tests.server.conftest import API_KEY, REFERENCE_ENGINE, Server, free_port, spawn_server, wait_healthy
from tests.server.disagg_faults import DIE_TOKENS

pytestmark = pytest.mark.slow_file(seconds=50)  # scheduled first: never the run's tail

AUTH = {"Authorization": f"Bearer {API_KEY}"}
ENGINE = (*REFERENCE_ENGINE, "--kv-transfer-timeout", "5")  # the co-located reference's engine flags
TIMEOUT = 60.0


@dataclass
class Deployment:
    prefill: list[Server]
    decode: list[Server]
    routers: dict[str, Router]  # "1x1", "1x2" (prefill x decode), "2x1"

    def workers(self) -> list[Server]:
        return [*self.prefill, *self.decode]


@dataclass
class Router:
    url: str
    stop: Callable[[], None]


def _router_process(prefill: list[Server], decode: list[Server]) -> Router:
    """``hybridserve router`` as its users start it."""
    port = free_port()
    cmd = [sys.executable, "-m", "hybridserve.cli", "router", "--port", str(port), "--log-level", "warning"]
    cmd += ["--health-interval", "0.2", "--health-timeout", "1", "--health-failures", "2"]
    for p in prefill:
        cmd += ["--prefill", p.url]
    for d in decode:
        cmd += ["--decode", d.url]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    process = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def stop() -> None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    return Router(f"http://127.0.0.1:{port}", stop)


def _router_thread(prefill: list[Server], decode: list[Server]) -> Router:
    """The same app in a thread of this process (a router holds no model: this saves a process start)."""
    settings = RouterSettings(
        [p.url for p in prefill],
        [d.url for d in decode],
        health_interval_s=0.2,
        health_timeout_s=1,
        health_failures=2,
    )
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_router_app(settings), port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=20)

    return Router(f"http://127.0.0.1:{port}", stop)


def _wait_router(router: Router, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{router.url}/health", timeout=1).status_code == 200:
                return
        assert time.monotonic() < deadline, "the router did not become healthy"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def deployment(tiny_checkpoint: Callable[[str], Path]) -> Iterator[Deployment]:
    folder = tiny_checkpoint("mixed")
    prefill = [
        spawn_server(folder, "--disaggregation-mode", "prefill", *ENGINE),
        spawn_server(
            folder,
            "--disaggregation-mode",
            "prefill",
            *ENGINE,
            plugins="tests.server.disagg_faults:die_mid_transfer",
        ),
    ]
    decode = [spawn_server(folder, "--disaggregation-mode", "decode", *ENGINE) for _ in range(2)]
    shapes = {"1x1": (prefill[:1], decode[:1]), "1x2": (prefill[:1], decode), "2x1": (prefill, decode[:1])}
    routers: dict[str, Router] = {}
    try:
        for s in [*prefill, *decode]:
            wait_healthy(s, timeout_s=420)  # several model loads at once on a small, shared machine
        routers = {
            shape: (_router_process if shape == "1x1" else _router_thread)(*w) for shape, w in shapes.items()
        }
        for r in routers.values():
            _wait_router(r)
        yield Deployment(prefill, decode, routers)
    finally:
        for r in routers.values():
            r.stop()
        for s in [*prefill, *decode]:
            if s.process.poll() is None:
                s.process.send_signal(signal.SIGTERM)
        for s in [*prefill, *decode]:
            try:
                s.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                s.process.kill()
                s.process.wait()


def _post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=AUTH, timeout=TIMEOUT)


def _stream(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream(
        "POST", f"{url}{path}", json=dict(body, stream=True), headers=AUTH, timeout=TIMEOUT
    ) as r:
        assert r.status_code == 200, r.read()
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _choices(data: dict[str, Any]) -> list[tuple[str, str | None]]:
    out = []
    for c in data["choices"]:
        text = c["message"]["content"] if "message" in c else c["text"]
        out.append((text, c["finish_reason"]))
    return out


def _streamed(events: list[dict[str, Any]]) -> list[tuple[str, str | None]]:
    texts: dict[int, list[str]] = {}
    finish: dict[int, str | None] = {}
    for e in events:
        assert "error" not in e, e
        for c in e["choices"]:
            piece = c["delta"].get("content") if "delta" in c else c["text"]
            texts.setdefault(c["index"], []).append(piece or "")
            finish[c["index"]] = c.get("finish_reason") or finish.get(c["index"])
    return [("".join(texts[i]), finish[i]) for i in sorted(texts)]


def _wait_idle(servers: list[Server]) -> None:
    for s in servers:
        s.wait_idle(timeout=15)


def _same(router: Router, reference: Server, path: str, body: dict[str, Any]) -> None:
    ref = _post(reference.url, path, body)
    got = _post(router.url, path, body)
    assert got.status_code == ref.status_code == 200, got.text
    assert _choices(got.json()) == _choices(ref.json())
    assert got.json()["usage"]["completion_tokens"] == ref.json()["usage"]["completion_tokens"]


def _bodies(model: str) -> list[tuple[str, dict[str, Any]]]:
    """Prompts across block, window and compressed-row boundaries; n > 1, stop strings, chat."""
    greedy = {"model": model, "temperature": 0, "max_tokens": 12}
    ids = [[(7 * i + k) % 300 + 5 for i in range(n)] for k, n in enumerate((3, 9, 17, 40))]
    out = [("/v1/completions", dict(greedy, prompt=p)) for p in ids]
    out.append(("/v1/completions", dict(greedy, prompt="It is a truth universally acknowledged", n=2)))
    out.append(("/v1/completions", dict(greedy, prompt=ids[2], stop=["a", "e", " "], max_tokens=30)))
    out.append(("/v1/chat/completions", dict(greedy, messages=[{"role": "user", "content": "Hello there"}])))
    out.append(("/v1/completions", dict(greedy, prompt=ids[3], max_tokens=1)))
    return out


def test_greedy_through_the_router_equals_colocated(deployment: Deployment, server: Server) -> None:
    router = deployment.routers["1x1"]
    bodies = _bodies(server.model)
    with ThreadPoolExecutor(len(bodies)) as pool:  # concurrent: decodes and prefills share steps
        list(pool.map(lambda pb: _same(router, server, *pb), bodies))
    for path, body in bodies[3:]:
        assert _streamed(_stream(router.url, path, body)) == _choices(_post(server.url, path, body).json())
    _wait_idle(deployment.workers())
    for worker in (deployment.prefill[0], deployment.decode[0]):  # both ends count what moved, per group
        m = worker.metrics()
        assert m["hybridserve_kv_handoff_transfers_total"] >= len(bodies) - 1
        assert len([k for k in m if k.startswith("hybridserve_kv_handoff_bytes_total{")]) == 5


def test_seeded_sampling_equals_colocated(deployment: Deployment, server: Server) -> None:
    body = {"model": server.model, "prompt": "My dear Mr. Bennet", "max_tokens": 16, "temperature": 0.9}
    _same(deployment.routers["1x1"], server, "/v1/completions", dict(body, seed=11, n=3, top_p=0.95))
    _same(
        deployment.routers["1x1"],
        server,
        "/v1/chat/completions",
        {"model": server.model, "messages": [{"role": "user", "content": "hi"}], "seed": 3, "max_tokens": 9},
    )


def test_max_tokens_one_finishes_on_the_prefill_worker(deployment: Deployment, server: Server) -> None:
    decode = deployment.decode[0]
    before = decode.metrics().get('hybridserve_requests_finished_total{finish_reason="length"}', 0.0)
    body = {"model": server.model, "prompt": "Emma Woodhouse", "max_tokens": 1, "temperature": 0}
    _same(deployment.routers["1x1"], server, "/v1/completions", body)
    assert _streamed(_stream(deployment.routers["1x1"].url, "/v1/completions", body))[0][1] == "length"
    assert decode.metrics().get('hybridserve_requests_finished_total{finish_reason="length"}', 0.0) == before


def test_a_prefix_hit_on_the_prefill_worker_shortens_prefill(deployment: Deployment, server: Server) -> None:
    body = {
        "model": server.model,
        "prompt": [(5 * i) % 290 + 9 for i in range(45)],
        "max_tokens": 4,
        "temperature": 0,
    }
    first = _post(deployment.routers["1x1"].url, "/v1/completions", body).json()
    again = _post(deployment.routers["1x1"].url, "/v1/completions", body).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 40  # whole blocks
    assert _choices(again) == _choices(first) == _choices(_post(server.url, "/v1/completions", body).json())


@pytest.mark.parametrize("shape", ["2x1", "1x2"])
def test_several_prefill_or_decode_workers(deployment: Deployment, server: Server, shape: str) -> None:
    router = deployment.routers[shape]
    pool = deployment.prefill if shape == "2x1" else deployment.decode
    key = "hybridserve_prompt_tokens_total" if shape == "2x1" else "hybridserve_generation_tokens_total"
    before = [s.metrics().get(key, 0.0) for s in pool]
    bodies = [("/v1/completions", b) for _, b in _bodies(server.model)[:4]] * 2
    with ThreadPoolExecutor(len(bodies)) as ex:
        list(ex.map(lambda pb: _same(router, server, *pb), bodies))
    after = [s.metrics().get(key, 0.0) for s in pool]
    assert all(a > b for a, b in zip(after, before, strict=True)), "a worker got no request"
    _wait_idle(deployment.workers())


def test_a_client_disconnect_frees_blocks_on_both_sides(deployment: Deployment, server: Server) -> None:
    body = {"model": server.model, "prompt": "Pride", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST", f"{deployment.routers['1x1'].url}/v1/completions", json=body, headers=AUTH, timeout=TIMEOUT
    ) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
    _wait_idle(deployment.workers())


def test_an_abort_through_the_router_frees_blocks_on_both_sides(
    deployment: Deployment, server: Server
) -> None:
    router = deployment.routers["1x1"]
    body = {"model": server.model, "prompt": "Sense", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, headers=AUTH, timeout=TIMEOUT) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data: {"))
        request_id = json.loads(next(lines).removeprefix("data: "))["id"]
        aborted = httpx.post(f"{router.url}/v1/requests/{request_id}/abort", headers=AUTH, timeout=TIMEOUT)
        assert aborted.status_code == 200 and aborted.json()["aborted"] == 1, aborted.text
        assert json.loads(list(lines)[-1].removeprefix("data: "))["choices"][0]["finish_reason"] == "abort"
    _wait_idle(deployment.workers())
    missing = httpx.post(f"{router.url}/v1/requests/{request_id}/abort", headers=AUTH, timeout=TIMEOUT)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "request_not_found"


def test_a_cache_reset_through_the_router_resets_every_worker(deployment: Deployment, server: Server) -> None:
    router = deployment.routers["1x2"]
    body = {
        "model": server.model,
        "prompt": "It is a truth universally acknowledged, that a single",
        "max_tokens": 2,
    }
    assert _post(router.url, "/v1/completions", body).status_code == 200
    workers = [deployment.prefill[0], *deployment.decode]
    _wait_idle(workers)
    assert deployment.prefill[0].metrics()['hybridserve_kv_blocks_cached{group="swa_kv"}'] > 0
    reset = httpx.post(f"{router.url}/v1/cache/reset", headers=AUTH | {"content-type": "application/json"})
    assert reset.status_code == 200 and reset.json() == {"reset": True, "workers": 3}, reset.text
    for w in workers:
        assert all(v == 0 for k, v in w.metrics().items() if k.startswith("hybridserve_kv_blocks_cached"))


@pytest.mark.parametrize("content", [b"\xff\xfe not json", b'{"prompt": ', b"[]"])
def test_a_malformed_body_through_the_router_is_a_400(deployment: Deployment, content: bytes) -> None:
    url = f"{deployment.routers['1x1'].url}/v1/completions"
    r = httpx.post(url, content=content, headers=AUTH | {"content-type": "application/json"}, timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text


def test_a_prefill_worker_dying_mid_transfer_frees_the_decode_blocks(
    deployment: Deployment, server: Server
) -> None:
    victim, decode = deployment.prefill[1], deployment.decode[0]
    body = {
        "model": server.model,
        "prompt": list(range(10, 10 + DIE_TOKENS)),
        "max_tokens": 5,
        "temperature": 0,
    }
    answer = _post(victim.url, "/v1/completions", dict(body, kv_transfer_params={"do_remote_decode": True}))
    assert answer.status_code == 200
    start = time.monotonic()
    r = _post(
        decode.url, "/v1/completions", dict(body, kv_transfer_params=answer.json()["kv_transfer_params"])
    )
    error = r.json()["error"]
    assert r.status_code == 503 and error["code"] == "kv_handoff_failed", r.text  # retryable elsewhere
    assert "KV handoff" in error["message"]
    assert time.monotonic() - start < 9  # a dead peer is noticed at once or at --kv-transfer-timeout
    assert victim.process.wait(timeout=10) != 0
    decode.wait_idle()
    router = deployment.routers["2x1"]
    deadline = time.monotonic() + 10
    while (
        f'hybridserve_router_worker_up{{role="prefill",url="{victim.url}"}} 0.0'
        not in httpx.get(f"{router.url}/metrics").text
    ):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    _same(
        router,
        server,
        "/v1/completions",
        {"model": server.model, "prompt": "Mansfield", "max_tokens": 5, "temperature": 0},
    )


def _signal_mid_stream(deployment: Deployment, sig: signal.Signals) -> tuple[Server, list[str], float]:
    """Stream a long completion through the 1x2 router, send ``sig`` to the decode worker serving it;
    -> (that worker, the rest of the stream, seconds from the signal to the stream's end)."""
    body = {
        "model": deployment.prefill[0].model,
        "prompt": "Northanger",
        "max_tokens": 400,
        "ignore_eos": True,
    }
    url = f"{deployment.routers['1x2'].url}/v1/completions"
    with httpx.stream("POST", url, json=dict(body, stream=True), headers=AUTH, timeout=TIMEOUT) as r:
        lines = (line for line in r.iter_lines() if line)
        next(lines)
        running = [d.metrics().get("hybridserve_num_requests_running", 0.0) for d in deployment.decode]
        victim = deployment.decode[running.index(max(running))]
        victim.process.send_signal(sig)
        start = time.monotonic()
        rest = list(lines)
    return victim, rest, time.monotonic() - start


def _assert_failed_with_json_error(victim: Server, rest: list[str], seconds: float) -> None:
    assert seconds < 5, "the client waited too long for the failed worker"
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2].removeprefix("data: "))["error"]
    assert error["type"] == "server_error" and victim.url in error["message"]


def _wait_worker_up(router: Router, worker: Server, up: bool) -> None:
    line = f'hybridserve_router_worker_up{{role="decode",url="{worker.url}"}} {float(up)}'
    deadline = time.monotonic() + 10
    while line not in httpx.get(f"{router.url}/metrics").text:
        assert time.monotonic() < deadline, f"the router did not mark {worker.url} {'up' if up else 'down'}"
        time.sleep(0.05)


def test_a_hung_decode_worker_is_marked_down_then_taken_back(deployment: Deployment, server: Server) -> None:
    victim, rest, seconds = _signal_mid_stream(deployment, signal.SIGSTOP)
    try:
        _assert_failed_with_json_error(victim, rest, seconds)
        _wait_worker_up(deployment.routers["1x2"], victim, False)
    finally:
        victim.process.send_signal(signal.SIGCONT)
    _wait_worker_up(deployment.routers["1x2"], victim, True)
    victim.wait_idle()  # the router dropped the stream: the worker aborted it and freed its blocks


def test_a_decode_worker_killed_mid_stream(deployment: Deployment, server: Server) -> None:
    router = deployment.routers["1x2"]
    victim, rest, seconds = _signal_mid_stream(deployment, signal.SIGKILL)
    _assert_failed_with_json_error(victim, rest, seconds)
    assert httpx.get(f"{router.url}/health").status_code == 200  # the router stays up, on the survivor
    done = {"model": server.model, "prompt": "Persuasion", "max_tokens": 6, "temperature": 0}
    for _ in range(3):
        _same(router, server, "/v1/completions", done)
    _wait_idle([deployment.prefill[0], *[d for d in deployment.decode if d is not victim]])
    assert victim.process.wait(timeout=10) != 0
