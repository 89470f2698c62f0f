"""``hybridserve router`` stops cleanly on SIGTERM: exit status 0, as ``hybridserve serve`` does."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx

from hybridserve.bench.server_process import free_port


def test_sigterm_exits_0() -> None:
    port = free_port()
    workers = ["--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9"]  # none up: health 503
    cmd = [sys.executable, "-m", "hybridserve.cli", "router", "--port", str(port), *workers]
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None and time.monotonic() < deadline, "the router did not start"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 503:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
