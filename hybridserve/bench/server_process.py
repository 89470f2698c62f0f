"""A server process for benchmarks: a free port, waiting until healthy, its metrics, stopping it."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, process: subprocess.Popen | None = None, timeout: float = 120.0) -> None:
    """Return once ``GET /health`` answers 200; raise if ``process`` exits first or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} while starting")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server at {url} did not become healthy in {timeout:.0f} s")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {"name{labels}": value}."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def stop(process: subprocess.Popen, grace: float = 30.0) -> int:
    """SIGTERM, then SIGKILL after ``grace`` seconds; -> the exit status (-9 when killed)."""
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return -9


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, whichever of its threads started it."""
    kids: list[str] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += (task / "children").read_text().split()
        except OSError:
            continue
    return [int(k) for k in kids] + [g for k in kids for g in descendants(int(k))]


def rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` and all its descendants (the API and engine-core processes)."""
    total = 0
    for p in [pid, *descendants(pid)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024
