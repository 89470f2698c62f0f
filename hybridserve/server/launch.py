"""``hybridserve serve``: build the app and run it under uvicorn until SIGINT / SIGTERM."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from types import FrameType

import uvicorn

from hybridserve.config import EngineConfig
from hybridserve.server.openai_api import build_app
from hybridserve.server.serving import ServerSettings, generation_defaults


class _Server(uvicorn.Server):
    """uvicorn re-raises SIGTERM after a graceful shutdown (exit status -15); we exit 0 instead."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        self._captured_signals.clear()


def settings_from_args(args: argparse.Namespace, config: EngineConfig) -> ServerSettings:
    return ServerSettings(
        model_name=args.served_model_name or Path(config.model).name,
        api_key=args.api_key,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        generation_defaults=generation_defaults(config.model),
    )


def serve(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = EngineConfig.from_cli(args)
    settings = settings_from_args(args, config)
    app = build_app(config, settings)
    server = _Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=int(args.shutdown_grace),
        )
    )
    logging.getLogger("hybridserve.server").info(
        "serving %s at http://%s:%d/v1 (health: /health, metrics: /metrics)",
        settings.model_name,
        args.host,
        args.port,
    )
    server.run()
    return 0
