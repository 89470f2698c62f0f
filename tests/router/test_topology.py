"""``hybridserve launch``: one command stands up a router, a prefill side and a 2-rank expert-parallel
decode side on two loopback addresses (nothing assumes one address), prints where each listens, serves
the OpenAI API through the router exactly as a co-located engine, and leaves no process behind on SIGTERM;
``--dry-run`` prints the per-host command lines."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from hybridserve.cli import main
from tests.server.conftest import free_port

PREFILL_HOST, DECODE_HOST = "127.0.0.2", "127.0.0.1"
ENGINE = ("--block-tokens", "8", "--num-threads", "1", "--max-num-seqs", "4", "--kv-transfer-timeout", "5")


def test_dry_run_prints_one_command_line_per_process(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["launch", "--dry-run", "--prefill-dp", "2", "--decode-dp", "2", "--enable-expert-parallel"]
    argv += ["--prefill-host", "10.0.0.1", "--decode-host", "10.0.0.2", "--port", "9000", "--model", "/m"]
    assert main(argv) == 0
    commands = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    prefill, decode, router = commands
    for line, mode, host, port in (
        (prefill, "prefill", "10.0.0.1", 9001),
        (decode, "decode", "10.0.0.2", 9002),
    ):
        assert line.startswith(f"hybridserve serve --disaggregation-mode {mode} --data-parallel-size 2")
        assert f"--host {host} --port {port} --disaggregation-bootstrap-host {host}" in line
        assert "--model /m" in line and "--enable-expert-parallel" in line
    assert router.startswith(
        "hybridserve router --prefill http://10.0.0.1:9001 --decode http://10.0.0.2:9002"
    )


def _read_until_router(process: subprocess.Popen[str]) -> dict[str, tuple[str, int]]:
    """The launcher's announcements: name -> (url, pid); the router's line comes last."""
    listening: dict[str, tuple[str, int]] = {}
    assert process.stdout is not None
    for line in process.stdout:  # bounded: the launcher gives up after --ready-timeout
        m = re.match(r"(prefill|decode|router): (\S+) .*pid (\d+)", line)
        if m:
            listening[m.group(1)] = (m.group(2).removesuffix("/v1"), int(m.group(3)))
        if "router" in listening:
            return listening
    raise AssertionError(f"the launcher ended early (status {process.wait()})")


def test_launch_on_two_addresses_serves_and_stops_everything(tiny_checkpoint: Callable[[str], Path]) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "hybridserve.cli", "launch", "--port", str(port), "--log-level", "warning"]
    cmd += ["--prefill-host", PREFILL_HOST, "--prefill-port", str(free_port())]
    cmd += ["--decode-host", DECODE_HOST, "--decode-port", str(free_port()), "--ready-timeout", "400"]
    cmd += ["--decode-dp", "2", "--enable-expert-parallel", "--model", str(tiny_checkpoint("mixed")), *ENGINE]
    process = subprocess.Popen(
        cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE, text=True
    )
    try:
        listening = _read_until_router(process)
        assert listening["prefill"][0].startswith(f"http://{PREFILL_HOST}:")
        assert listening["decode"][0].startswith(f"http://{DECODE_HOST}:")
        body = {
            "model": "x",
            "prompt": [5, 9, 11, 40, 7, 3, 2, 19, 23, 8, 6],
            "max_tokens": 8,
            "temperature": 0,
        }
        body["model"] = httpx.get(f"{listening['router'][0]}/v1/models").json()["data"][0]["id"]
        routed = httpx.post(f"{listening['router'][0]}/v1/completions", json=body, timeout=60)
        # The prefill side runs requests without kv_transfer_params co-located: the reference.
        colocated = httpx.post(f"{listening['prefill'][0]}/v1/completions", json=body, timeout=60)
        assert routed.status_code == colocated.status_code == 200, routed.text
        assert routed.json()["choices"][0]["text"] == colocated.json()["choices"][0]["text"]
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        for _, pid in listening.values():
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
