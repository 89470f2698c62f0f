"""The deployment a soak runs against: one server, or a router in front of prefill and decode workers.

Each unit is one ``hybridserve serve`` (with its engine-core processes). Under chaos a unit whose server
process died is started again on its port (``--restart``); what the soak then checks is that the
survivors hold no blocks, that no process outlived its killed parent, and that the front answers again.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
from dataclasses import dataclass, field

from hybridserve.bench.server_process import descendants, free_port, stop, wait_healthy
from hybridserve.config import default_model_path

START_TIMEOUT_S = 420.0  # several model loads at once on a small machine
EXIT_TIMEOUT_S = 60.0  # a server whose engine core died exits within seconds (the core's RPC timeout)


@dataclass
class Unit:
    name: str  # "server", "prefill-0", "decode-1"
    cmd: list[str]
    url: str
    process: subprocess.Popen | None = None
    exits: list[int] = field(default_factory=list)  # exit statuses of the processes that died
    healthy: bool = False  # answered /health since it was last started (chaos spares it until then)

    def start(self) -> None:
        self.process = subprocess.Popen(self.cmd, stdout=sys.stderr, stderr=sys.stderr)
        self.healthy = False

    def wait_healthy(self) -> None:
        wait_healthy(self.url, self.process, timeout=START_TIMEOUT_S)
        self.healthy = True

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


def serve_cmd(args: argparse.Namespace, port: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "hybridserve.cli", "serve",
        "--model", str(args.model or default_model_path()),
        "--port", str(port),
        "--num-blocks", str(args.num_blocks),
        "--max-num-seqs", str(args.max_num_seqs),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--max-body-bytes", str(args.max_body_bytes),
        "--max-queue", str(4 * args.concurrency),
        "--reserve-lookahead", str(args.reserve_lookahead),
        "--num-threads", "1",
        "--log-level", "warning",
        *extra,
        *args.server_arg,
    ]  # fmt: skip


def _url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


@dataclass
class Deployment:
    units: list[Unit]
    front_url: str
    router: Unit | None = None
    restart: bool = False
    ready: asyncio.Event | None = None  # set while the front answers (cleared while it restarts)
    hangs: list[str] = field(default_factory=list)  # servers that did not exit after losing a core
    _going_down: bool = False
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @classmethod
    def build(cls, args: argparse.Namespace) -> Deployment:
        if args.deployment == "serve":
            port = free_port()
            return cls([Unit("server", serve_cmd(args, port), _url(port))], _url(port), restart=args.restart)
        units = []
        for role, count in (("prefill", args.prefill_workers), ("decode", args.decode_workers)):
            for i in range(count):
                port = free_port()
                cmd = serve_cmd(args, port, "--disaggregation-mode", role)
                units.append(Unit(f"{role}-{i}", cmd, _url(port)))
        port = free_port()
        flags = [f"--{u.name.split('-')[0]}={u.url}" for u in units]
        router_cmd = [sys.executable, "-m", "hybridserve.cli", "router", "--port", str(port), *flags]
        return cls(units, _url(port), Unit("router", router_cmd, _url(port)), restart=args.restart)

    def start(self) -> None:
        for u in self.units:
            u.start()
        for u in self.units:
            u.wait_healthy()
        if self.router is not None:
            self.router.start()
            self.router.wait_healthy()

    def worker_pids(self) -> list[int]:
        """Every process of every unit (the server processes and their engine cores), not the router."""
        roots = [u.process.pid for u in self.units if u.alive and u.healthy and u.process is not None]
        return roots + [d for r in roots for d in descendants(r)]

    def killed(self) -> None:
        """Chaos just killed a process of a unit. With no router in front, the server is expected to go
        down (an engine core's death ends it, by design): its clients wait until it is back."""
        if self.router is None and self.restart and self.ready is not None:
            self.ready.clear()
            self._going_down = True

    async def revive(self) -> None:
        """Start again every unit whose server process died (with ``restart``); the front's clients wait."""
        async with self._lock:
            if self._going_down:
                self._going_down = False
                await asyncio.to_thread(self._wait_exit, self.units[0])
            dead = [u for u in self.units if u.process is not None and not u.alive]
            if dead and self.restart:
                await self._start_again(dead)

    def _wait_exit(self, unit: Unit) -> None:
        """A server that lost an engine core must exit by itself, soon; one that does not is a hang."""
        assert unit.process is not None
        try:
            unit.process.wait(timeout=EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.hangs.append(f"{unit.name} still running {EXIT_TIMEOUT_S:.0f} s after an engine core died")
            unit.process.kill()
            unit.process.wait()

    async def _start_again(self, dead: list[Unit]) -> None:
        front_down = self.router is None
        if front_down and self.ready is not None:
            self.ready.clear()
        for u in dead:
            assert u.process is not None
            u.exits.append(u.process.returncode)
            u.start()
        for u in dead:
            try:
                await asyncio.to_thread(u.wait_healthy)
            except RuntimeError as exc:  # killed again while starting, say: the next call starts it again
                print(f"soak: {u.name} did not come back: {exc}", file=sys.stderr)
        if front_down and self.ready is not None:
            self.ready.set()

    def live_units(self) -> list[Unit]:
        return [u for u in self.units if u.alive]

    def rss_pids(self) -> list[int]:
        """The processes whose memory the soak samples (each with its descendants)."""
        return [u.process.pid for u in [*self.units, self.router] if u is not None and u.process is not None]

    def stop(self) -> dict[str, int]:
        """SIGTERM every process; -> unit name -> exit status (router first, so it stops routing)."""
        codes = {}
        for u in [*([self.router] if self.router else []), *self.units]:
            if u.process is not None:
                codes[u.name] = stop(u.process) if u.process.poll() is None else u.process.returncode
        return codes


def add_deployment_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--deployment",
        choices=["serve", "disagg"],
        default="serve",
        help="started servers: one server, or a router in front of prefill and decode workers",
    )
    p.add_argument("--prefill-workers", type=int, default=2, help="--deployment disagg: prefill workers")
    p.add_argument("--decode-workers", type=int, default=2, help="--deployment disagg: decode workers")
    p.add_argument("--restart", action="store_true", help="chaos: start a unit again when its server dies")
