"""A real server process on a free loopback port, started once for the module and reaped after."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from hybridserve.bench.server_process import parse_metrics

API_KEY = "test-key"
REFERENCE_ENGINE = ("--api-key", API_KEY, "--max-num-seqs", "8", "--max-num-batched-tokens", "64")


@dataclass
class Server:
    url: str
    model: str
    folder: Path
    process: subprocess.Popen

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(f"{self.url}/metrics").text)

    def kv_blocks_used(self) -> float:
        return sum(v for k, v in self.metrics().items() if k.startswith("hybridserve_kv_blocks_used"))

    def wait_idle(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = self.metrics()
            if self.kv_blocks_used() == 0 and m.get("hybridserve_num_requests_running") == 0:
                return
            time.sleep(0.02)
        raise AssertionError(f"the engine still holds blocks: {self.kv_blocks_used()}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(folder: Path, *extra: str, plugins: str = "") -> Server:
    return wait_healthy(spawn_server(folder, *extra, plugins=plugins))


def spawn_server(
    folder: Path, *extra: str, plugins: str = "", port: int | None = None, new_session: bool = False
) -> Server:
    """Start a server process (``wait_healthy`` waits for it): start several, then wait for them all.
    ``new_session``: in a process group of its own (its pid is the group id), as a terminal would run it.
    Eager (``--enforce-eager``) unless ``extra`` names a compile flag."""
    port = port or free_port()
    compiles = any(a.startswith(("--compile", "--no-compile", "--no-enforce-eager")) for a in extra)
    cmd = [
        sys.executable,
        "-m",
        "hybridserve.cli",
        "serve",
        "--model",
        str(folder),
        "--port",
        str(port),
        "--block-tokens",
        "8",
        "--num-threads",
        "1",
        "--log-level",
        "warning",
        *([] if compiles else ["--enforce-eager"]),
        *extra,
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", HYBRIDSERVE_PLUGINS=plugins)
    process = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=new_session,
    )
    return Server(f"http://127.0.0.1:{port}", folder.name, folder, process)


def wait_healthy(server: Server, timeout_s: float = 180) -> Server:
    process = server.process
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited: {process.stdout.read() if process.stdout else ''}")
        try:
            if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    process.terminate()  # not kill: the server must stop its engine-core process
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    raise RuntimeError("server did not become healthy")


def stop_server(server: Server, grace: float = 20.0) -> int:
    server.process.send_signal(signal.SIGTERM)
    try:
        return server.process.wait(timeout=grace)
    finally:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()


@pytest.fixture(scope="package")
def server(tiny_checkpoint: Callable[[str], Path]) -> Iterator[Server]:
    s = start_server(
        tiny_checkpoint("mixed"),
        *REFERENCE_ENGINE,
        "--max-queue",
        "24",
        "--max-body-bytes",
        "65536",
    )
    yield s
    assert stop_server(s) == 0


@pytest.fixture(autouse=True)
def kv_back_to_zero(request: pytest.FixtureRequest) -> Iterator[None]:
    """After every server test, every request has left the pools."""
    yield
    if "server" in request.fixturenames:
        request.getfixturevalue("server").wait_idle()
