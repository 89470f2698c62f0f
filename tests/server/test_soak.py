"""A short soak in CI: mixed, hostile traffic against a tight-pool server, then no leak and no 5xx.

The full run (5,000 requests, bundled model) is in benchmarks/README.md; this is the same code,
100 requests against a tiny model.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from hybridserve.bench.server_process import descendants
from hybridserve.bench.soak import run_soak
from hybridserve.bench.soak_chaos import Chaos, casualty, command_line
from hybridserve.cli import build_parser


def test_short_soak_leaves_nothing_behind(tiny_checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    result = tmp_path / "soak.json"
    args = build_parser().parse_args(
        [
            "bench", "soak",
            "--model", str(tiny_checkpoint("mixed")),
            "--requests", "100",
            "--concurrency", "12",
            "--num-blocks", "40",
            "--server-arg=--block-tokens=8",
            "--server-arg=--enforce-eager",
            "--rss-bound-mib", "64",
            "--latency-factor", "1000",  # too few requests per quarter to judge drift on a shared CI machine
            "--result-json", str(result),
        ]
    )  # fmt: skip
    code = run_soak(args)
    report = json.loads(result.read_text())
    assert code == 0, report["failures"]
    assert report["requests"] == 100 and report["server_errors"] == 0 and not report["problems"]
    assert report["preemptions"] > 0 and report["evictions"] > 0
    assert not any(report["kv_blocks_used_after"].values()) and report["server_exit"] == 0
    assert {"abort", "disconnect", "malformed", "oversize", "n_gt_1"} <= set(report["by_kind"])


def test_chaos_kills_one_matching_worker_every_n_requests() -> None:
    """The hook the soak uses against multi-worker servers: SIGKILL one matching descendant per period."""
    spawn = (
        "import subprocess, sys, time; [subprocess.Popen(['sleep', '60']) for _ in range(2)]; time.sleep(60)"
    )
    parent = subprocess.Popen([sys.executable, "-c", spawn], start_new_session=True)
    try:
        chaos = Chaos(every=3, match="sleep")
        deadline = time.monotonic() + 30
        while len(workers := [p for p in descendants(parent.pid) if "sleep" in command_line(p)]) < 2:
            assert time.monotonic() < deadline, "the workers did not start"
            time.sleep(0.05)
        for done in (1, 2, 3, 4, 5):
            chaos.after(done, [parent.pid, *descendants(parent.pid)])
        assert [done for done, _ in chaos.kills] == [3] and chaos.kills[0][1] in workers
        assert parent.poll() is None  # only a matching process, never the server itself
        assert chaos.outlived(grace_s=0) == []  # a sleep has no children
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait(timeout=30)


def test_what_counts_as_a_casualty_of_a_kill() -> None:
    assert casualty(0, "RemoteProtocolError: Server disconnected")
    assert casualty(200, "stream ended without [DONE]")
    assert casualty(200, "error event: {'code': 'worker_failed'}")
    assert casualty(502, "status 502: worker_failed")
    assert casualty(200, "error event: {'code': 'engine_failed'}")
    assert casualty(200, "error event: {'code': 'kv_handoff_failed'}")
    assert not casualty(200, "")  # a right answer
    assert not casualty(200, "stop string left in the text")  # a wrong answer stays wrong
    assert not casualty(400, "status 400 without an OpenAI-style JSON error")
    assert not casualty(500, "status 500: internal error: AttributeError")  # a bug, killed or not
