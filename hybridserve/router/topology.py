"""``hybridserve launch``: a disaggregated deployment from one command, router and both sides.

On one host it starts a prefill side and a decode side (``hybridserve serve --disaggregation-mode ...``,
each ``--data-parallel-size N`` ranks) and then the router in front of them, as child processes; it prints
where each listens, and stops them all on Ctrl-C or SIGTERM (or when one of them exits). With ``--dry-run``
it prints the same processes as command lines to run on several hosts instead. Engine flags it does not
know go to both sides unchanged.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from types import FrameType

import httpx

HEALTH_POLL_S = 0.2


class ChildFailed(RuntimeError):
    pass


@dataclass
class Side:
    """One side of the deployment: its role, ranks and where its HTTP server (and KV handoff) listen."""

    mode: str  # prefill or decode
    ranks: int
    host: str
    port: int
    flags: list[str] = field(default_factory=list)  # engine flags for both sides

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        cmd = ["serve", "--disaggregation-mode", self.mode, "--data-parallel-size", str(self.ranks)]
        cmd += ["--host", self.host, "--port", str(self.port), "--disaggregation-bootstrap-host", self.host]
        return [*cmd, *self.flags]


@dataclass
class Topology:
    prefill: Side
    decode: Side
    host: str
    port: int
    router_flags: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def router_command(self) -> list[str]:
        cmd = ["router", "--prefill", self.prefill.url, "--decode", self.decode.url]
        return [*cmd, "--host", self.host, "--port", str(self.port), *self.router_flags]


def add_side_args(parser: argparse.ArgumentParser, default: int | None = 1) -> None:
    """The sides' sizes (``hybridserve plan`` takes them too, default None: plan one engine)."""
    plan = " (plan each side of a launch topology, rank by rank)" if default is None else ""
    parser.add_argument(
        "--prefill-dp", type=int, default=default, help=f"engine-core ranks of the prefill side{plan}"
    )
    parser.add_argument(
        "--decode-dp", type=int, default=default, help=f"engine-core ranks of the decode side{plan}"
    )


def add_launch_args(parser: argparse.ArgumentParser) -> None:
    add_side_args(parser)
    parser.add_argument(
        "--enable-expert-parallel", action="store_true", help="each side splits its experts over its ranks"
    )
    parser.add_argument(
        "--speculative-config", help="MTP speculation (JSON) on both sides; the prefill side fills the window"
    )
    parser.add_argument("--host", default="127.0.0.1", help="the router's bind address")
    parser.add_argument("--port", type=int, default=8000, help="the router's port (the API clients use)")
    parser.add_argument("--prefill-host", default="127.0.0.1", help="the prefill side's address")
    parser.add_argument("--prefill-port", type=int, help="the prefill side's HTTP port (default: --port + 1)")
    parser.add_argument("--decode-host", default="127.0.0.1", help="the decode side's address")
    parser.add_argument("--decode-port", type=int, help="the decode side's HTTP port (default: --port + 2)")
    parser.add_argument("--ready-timeout", type=float, default=1800.0, help="seconds to wait for the sides")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--dry-run", action="store_true", help="print the command line of each process")


def topology(args: argparse.Namespace, engine_flags: list[str]) -> Topology:
    if args.prefill_dp < 1 or args.decode_dp < 1:
        raise ValueError("--prefill-dp and --decode-dp must be >= 1")
    flags = [*engine_flags, "--log-level", args.log_level]
    if args.enable_expert_parallel:
        flags.append("--enable-expert-parallel")
    if args.speculative_config:
        flags += ["--speculative-config", args.speculative_config]
    prefill = Side("prefill", args.prefill_dp, args.prefill_host, args.prefill_port or args.port + 1, flags)
    decode = Side("decode", args.decode_dp, args.decode_host, args.decode_port or args.port + 2, flags)
    return Topology(prefill, decode, args.host, args.port, ["--log-level", args.log_level])


def dry_run(top: Topology) -> str:
    """The per-host recipe: each side on its own host (its address reachable by the other and the router)."""
    lines = []
    for side in (top.prefill, top.decode):
        lines.append(f"# {side.mode} side, {side.ranks} rank(s), on the host at {side.host}")
        lines.append(shlex.join(["hybridserve", *side.command()]))
    lines.append(f"# router, on the host clients reach at {top.host}")
    lines.append(shlex.join(["hybridserve", *top.router_command()]))
    return "\n".join(lines)


def run_launch(args: argparse.Namespace, engine_flags: list[str]) -> int:
    top = topology(args, engine_flags)
    if args.dry_run:
        print(dry_run(top))
        return 0
    return Launcher(top, args.ready_timeout).run()


class Launcher:
    """Owns the child processes: starts them, reports where they listen, stops every one of them."""

    def __init__(self, top: Topology, ready_timeout_s: float) -> None:
        self.top = top
        self.ready_timeout_s = ready_timeout_s
        self.children: dict[str, subprocess.Popen[bytes]] = {}

    def run(self) -> int:
        """0 when stopped by a signal; 1 when a child failed to start or exited on its own."""
        signal.signal(signal.SIGTERM, _interrupt)
        try:
            for side in (self.top.prefill, self.top.decode):
                self._start(side.mode, side.command())
            for side in (self.top.prefill, self.top.decode):
                self._wait_healthy(side.mode, side.url)
            self._start("router", self.top.router_command())
            self._wait_healthy("router", self.top.url)
            self._announce()
            self._watch()
        except KeyboardInterrupt:
            return 0
        except ChildFailed as exc:
            print(f"hybridserve launch: {exc}; stopping the others", file=sys.stderr, flush=True)
            return 1
        finally:
            self.stop()
        return 1

    def _start(self, name: str, command: list[str]) -> None:
        argv = [sys.executable, "-m", "hybridserve.cli", *command]
        self.children[name] = subprocess.Popen(argv, preexec_fn=_die_with_parent)

    def _wait_healthy(self, name: str, url: str) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while not _healthy(url):
            self._check_alive()
            if time.monotonic() > deadline:
                raise ChildFailed(f"the {name} at {url} was not healthy within {self.ready_timeout_s:g} s")
            time.sleep(HEALTH_POLL_S)

    def _announce(self) -> None:
        for side in (self.top.prefill, self.top.decode):
            pid = self.children[side.mode].pid
            print(f"{side.mode}: {side.url} ({side.ranks} rank(s), pid {pid})", flush=True)
        print(f"router: {self.top.url}/v1 (pid {self.children['router'].pid})", flush=True)

    def _watch(self) -> None:
        while True:
            self._check_alive()
            time.sleep(HEALTH_POLL_S)

    def _check_alive(self) -> None:
        for name, child in self.children.items():
            if child.poll() is not None:
                raise ChildFailed(f"the {name} exited with status {child.returncode}")

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM to every child (router first: it stops taking requests), then SIGKILL after ``grace_s``."""
        for child in reversed(self.children.values()):
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in self.children.values():
            try:
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def _interrupt(sig: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _die_with_parent() -> None:
    """Linux: the child gets SIGTERM if the launcher itself dies (even by SIGKILL): no orphans."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
