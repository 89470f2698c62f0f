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

    def workers(self, server_pid: int) -> list[int]:
        return [p for p in descendants(server_pid) if self.match in command_line(p)]

    def after(self, done: int, server_pid: int | None) -> None:
        """Called after each finished request: kill one worker when ``done`` is a multiple of ``every``."""
        if not self.every or server_pid is None or done % self.every:
            return
        workers = self.workers(server_pid)
        if workers:
            victim = self.rng.choice(workers)
            os.kill(victim, signal.SIGKILL)
            self.kills.append((done, victim))
