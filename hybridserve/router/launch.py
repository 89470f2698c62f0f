"""``hybridserve router``: flags and the uvicorn run of the disaggregation router."""

from __future__ import annotations

import argparse
import logging
from types import FrameType

import uvicorn

from hybridserve.router.app import RouterSettings, build_router_app


def add_router_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prefill", action="append", required=True, metavar="URL", help="a prefill worker (repeat for more)"
    )
    parser.add_argument(
        "--decode", action="append", required=True, metavar="URL", help="a decode worker (repeat for more)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address (loopback)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--worker-timeout", type=float, default=600.0, help="longest silence of a worker mid-request (s)"
    )
    parser.add_argument("--health-interval", type=float, default=1.0, help="seconds between worker checks")
    parser.add_argument(
        "--health-timeout", type=float, default=2.0, help="a /health slower than this failed its check"
    )
    parser.add_argument(
        "--health-failures",
        type=int,
        default=3,
        help="checks in a row that time out before a slow worker is down (a refused or failed one: at once)",
    )
    parser.add_argument("--max-body-bytes", type=int, default=4 << 20, help="larger request bodies get 413")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def run_router(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    settings = RouterSettings(
        prefill=args.prefill,
        decode=args.decode,
        worker_timeout_s=args.worker_timeout,
        health_interval_s=args.health_interval,
        health_timeout_s=args.health_timeout,
        health_failures=args.health_failures,
        max_body_bytes=args.max_body_bytes,
    )
    app = build_router_app(settings)
    logging.getLogger("hybridserve.router").info(
        "routing http://%s:%d/v1 to prefill %s, decode %s", args.host, args.port, args.prefill, args.decode
    )
    _RouterServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level)).run()
    return 0


class _RouterServer(uvicorn.Server):
    """Exits 0 on SIGTERM once its requests are done; uvicorn would re-raise the signal (status -15)."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        self._captured_signals.clear()
