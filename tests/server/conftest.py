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
    port = free_port()
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
        *extra,
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", HYBRIDSERVE_PLUGINS=plugins)
    process = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited: {process.stdout.read() if process.stdout else ''}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return Server(url, folder.name, folder, process)
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    process.kill()
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
        "--api-key",
        API_KEY,
        "--max-num-seqs",
        "8",
        "--max-num-batched-tokens",
        "64",
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
