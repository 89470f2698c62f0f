"""``hybridserve serve``: build the app and run it under uvicorn until SIGINT / SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
from pathlib import Path
from types import FrameType

import uvicorn

from hybridserve.config import EngineConfig
from hybridserve.server.openai_api import AppState, build_app
from hybridserve.server.serving import ServerSettings, generation_defaults
from hybridserve.tokenizer import load_chat_template

# uvicorn's own deadline comes this long after ours, so that requests we fail at ours can still send
# their error (a JSON 503, or an error event and [DONE]) before uvicorn cuts the connections.
_CLOSE_MARGIN_S = 5.0


class _Server(uvicorn.Server):
    """On SIGTERM: stop accepting, let in-flight requests finish for the grace period, then fail the
    rest with a 503 and exit 0. uvicorn would re-raise SIGTERM (exit status -15); we do not."""

    def __init__(self, config: uvicorn.Config, state: AppState, grace_s: float) -> None:
        super().__init__(config)
        self.state = state
        self.grace_s = grace_s
        state.request_exit = self._exit_soon

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            loop = asyncio.get_event_loop()
            loop.call_soon_threadsafe(self.state.begin_drain, self.grace_s)
        super().handle_exit(sig, frame)
        self._captured_signals.clear()

    def _exit_soon(self) -> None:
        self.should_exit = True


def settings_from_args(args: argparse.Namespace, config: EngineConfig) -> ServerSettings:
    names = args.served_model_name or [Path(config.model).name]
    return ServerSettings(
        model_name=names[0],
        model_aliases=list(names[1:]),
        chat_template=load_chat_template(args.chat_template) if args.chat_template else None,
        api_key=args.api_key,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        max_logprobs=args.max_logprobs,
        generation_defaults=generation_defaults(config.model),
        default_chat_template_kwargs=dict(args.default_chat_template_kwargs or {}),
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
    )


def serve(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = EngineConfig.from_cli(args)
    settings = settings_from_args(args, config)
    app = build_app(config, settings)
    state: AppState = app.state.hs
    server = _Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=math.ceil(args.shutdown_grace + _CLOSE_MARGIN_S),
        ),
        state,
        args.shutdown_grace,
    )
    logging.getLogger("hybridserve.server").info(
        "serving %s at http://%s:%d/v1 (health: /health, metrics: /metrics)",
        settings.model_name,
        args.host,
        args.port,
    )
    server.run()
    return 1 if state.fatal is not None else 0
