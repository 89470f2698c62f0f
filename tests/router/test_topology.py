"""``hybridserve launch``: the production topology from one command, checked against one process.

A router, a prefill side and a decode side of 2 expert-parallel ranks each, MTP (k = 2) on both sides and
an FP8 KV cache, the two sides on different loopback addresses (nothing assumes one address). Greedy
completions through the router, many in flight at once and of very different lengths, equal one
non-speculative process with the same FP8 cache token for token; the decode side's drafts are proposed
and accepted (oracle drafts, installed in every engine core through $HYBRIDSERVE_PLUGINS: only the decode
side drafts), every rank of both sides hands off, and SIGTERM leaves no process behind. ``--dry-run``
prints the per-host command lines.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from hybridserve import LLM, SamplingParams
from hybridserve.bench.server_process import parse_metrics
from hybridserve.cli import main
from tests.distributed.spec_oracle import ORACLE_ENV, write_oracle
from tests.server.conftest import Server, free_port, spawn_server, stop_server, wait_healthy

pytestmark = pytest.mark.slow_file(seconds=40)  # scheduled first: never the run's tail

PREFILL_HOST, DECODE_HOST = "127.0.0.2", "127.0.0.1"
ENGINE = ("--block-tokens", "8", "--num-threads", "1", "--max-num-seqs", "4", "--kv-transfer-timeout", "10")
ENGINE += ("--kv-cache-dtype", "fp8", "--kv-cache-memory", "64MiB", "--max-num-batched-tokens", "32")
SPEC = json.dumps({"method": "mtp", "num_speculative_tokens": 2, "adaptive": False})
PROMPTS = [[(7 * i + k) % 300 + 5 for i in range(n)] for k, n in enumerate((3, 40, 17, 9, 33, 5))]
MAX_TOKENS = [24, 3, 16, 2, 20, 12]


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


def _launch(folder: Path, oracle: Path) -> subprocess.Popen[str]:
    cmd = [
        sys.executable,
        "-m",
        "hybridserve.cli",
        "launch",
        "--port",
        str(free_port()),
        "--log-level",
        "warning",
    ]
    cmd += ["--prefill-host", PREFILL_HOST, "--prefill-port", str(free_port()), "--prefill-dp", "2"]
    cmd += ["--decode-host", DECODE_HOST, "--decode-port", str(free_port()), "--decode-dp", "2"]
    cmd += ["--enable-expert-parallel", "--speculative-config", SPEC, "--ready-timeout", "400"]
    cmd += ["--model", str(folder), *ENGINE]
    plugins = "tests.distributed.spec_oracle:install"
    env = dict(os.environ, PYTHONUNBUFFERED="1", HYBRIDSERVE_PLUGINS=plugins, **{ORACLE_ENV: str(oracle)})
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def reference(mtp_checkpoint: Callable[[str], Path]) -> Iterator[Server]:
    """One process, no speculation, the same FP8 cache."""
    server = wait_healthy(spawn_server(mtp_checkpoint("mixed"), *ENGINE), timeout_s=400)
    yield server
    stop_server(server)


def _bodies(model: str) -> list[dict[str, Any]]:
    return [
        {"model": model, "prompt": p, "max_tokens": n, "temperature": 0}
        for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)
    ]


def _texts(url: str, bodies: list[dict[str, Any]]) -> list[str]:
    with ThreadPoolExecutor(len(bodies)) as pool:
        responses = list(pool.map(lambda b: httpx.post(f"{url}/v1/completions", json=b, timeout=120), bodies))
    for r in responses:
        assert r.status_code == 200, r.text
    return [r.json()["choices"][0]["text"] for r in responses]


def _rank_handoffs(url: str) -> dict[str, float]:
    metrics = parse_metrics(httpx.get(f"{url}/metrics").text)
    return {k: v for k, v in metrics.items() if "dp_rank_kv_handoff_transfers" in k}


def test_the_production_topology_equals_one_process(
    mtp_checkpoint: Callable[[str], Path], reference: Server, tmp_path: Path
) -> None:
    folder = mtp_checkpoint("mixed")
    params = [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS]
    llm = LLM(str(folder), block_tokens=8, kv_cache_memory="64MiB", kv_cache_dtype="fp8", enforce_eager=True)
    write_oracle(
        tmp_path / "oracle.json", PROMPTS, [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    )
    process = _launch(folder, tmp_path / "oracle.json")
    try:
        listening = _read_until_router(process)
        prefill, decode, router = (listening[name][0] for name in ("prefill", "decode", "router"))
        assert prefill.startswith(f"http://{PREFILL_HOST}:") and decode.startswith(f"http://{DECODE_HOST}:")
        model = httpx.get(f"{router}/v1/models").json()["data"][0]["id"]
        ref_model = httpx.get(f"{reference.url}/v1/models").json()["data"][0]["id"]
        expected = _texts(reference.url, _bodies(ref_model))
        assert _texts(router, _bodies(model)) == expected
        m = parse_metrics(httpx.get(f"{decode}/metrics").text)
        assert m["hybridserve_spec_decode_num_drafts_total"] > 0
        assert m["hybridserve_spec_decode_num_accepted_tokens_total"] > 0
        for side in (prefill, decode):  # each side really runs 2 ranks, and each hands off
            done = _rank_handoffs(side)
            assert len(done) == 2 and all(v > 0 for v in done.values()), done
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        for _, pid in listening.values():
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
