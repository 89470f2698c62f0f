"""Chaos for the soak: SIGKILL a worker process of the server every so many requests.

Meant for servers made of several workers (prefill/decode disaggregation, expert-parallel ranks), whose
survivors must go on serving without leaking: the soak's usual checks still apply afterwards. A
co-located server exits 1 when its engine core dies (by design), so there it is not a test of survival.
Workers are the server's descendant processes whose command line contains ``match``.
"""

from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from hybridserve.bench.server_process import descendants


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@dataclass
class Chaos:
    every: int  # requests between kills; 0: never
    match: str
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    kills: list[tuple[int, int]] = field(default_factory=list)  # (requests done, pid killed)

    watched: list[int] = field(default_factory=list)  # children of the killed: they must not outlive them

    def after(self, done: int, processes: list[int]) -> None:
        """Called after each finished request: when ``done`` is a multiple of ``every``, SIGKILL one of
        ``processes`` whose command line has ``match``."""
        if not self.every or done % self.every:
            return
        workers = [p for p in processes if self.match in command_line(p)]
        if workers:
            victim = self.rng.choice(workers)
            self.watched.extend(descendants(victim))  # before the kill: then they are re-parented
            os.kill(victim, signal.SIGKILL)
            self.kills.append((done, victim))

    def outlived(self, grace_s: float = 30.0) -> list[int]:
        """Children of killed processes still running after ``grace_s`` (zombies do not count)."""
        deadline = time.monotonic() + grace_s
        while True:
            alive = [p for p in self.watched if _running(p)]
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.2)


def casualty(status: int, problem: str) -> bool:
    """A request that failed because a process serving it was killed: cut off (no status, or a stream
    without ``[DONE]``), a router's ``worker_failed`` 502 / error event, a server's ``engine_failed``
    error event (its engine core died: it exits, by design), a decode worker's ``kv_handoff_failed``
    error event (the prefill worker holding its blocks died), or a 502 / 503 of a server going down.
    A 500 is an internal error, never a casualty, whatever was killed."""
    cut = status == 0 or "without [DONE]" in problem
    named = any(code in problem for code in ("worker_failed", "engine_failed", "kv_handoff_failed"))
    return bool(problem) and (cut or named or status in (502, 503))


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
