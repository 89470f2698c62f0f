"""``hybridserve serve`` flags beyond the engine's."""

from __future__ import annotations

import argparse
import json
import os

from hybridserve.server.parser_names import REASONING_PARSERS, TOOL_CALL_PARSERS
from hybridserve.server.protocol import MAX_LOGPROBS


def add_server_args(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument(
        "--host", default=env("HYBRIDSERVE_HOST", "127.0.0.1"), help="bind address (loopback)"
    )
    parser.add_argument("--port", type=int, default=int(env("HYBRIDSERVE_PORT", "8000")))
    parser.add_argument("--api-key", default=env("HYBRIDSERVE_API_KEY"), help="require 'Bearer KEY' on /v1/*")
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model id(s) in the API: the first is reported, every one is accepted (default: folder name)",
    )
    parser.add_argument(
        "--chat-template",
        default=env("HYBRIDSERVE_CHAT_TEMPLATE"),
        help="Jinja chat template (a file, or the template itself) instead of the checkpoint's",
    )
    parser.add_argument(
        "--default-chat-template-kwargs",
        type=json.loads,
        default=None,
        help="JSON template options under each request's chat_template_kwargs, e.g. '{\"thinking\": false}'",
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="split the output's reasoning (message.reasoning_content) from its content",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help="read tool calls in this format (default: the tokenizer mode's; deepseek_v31 for templates)",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="with --tool-call-parser: read tool calls the model chooses to make (tool_choice auto)",
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=int(env("HYBRIDSERVE_MAX_QUEUE", "256")),
        help="waiting requests beyond this get 429 with Retry-After",
    )
    parser.add_argument("--max-body-bytes", type=int, default=4 << 20, help="larger request bodies get 413")
    parser.add_argument(
        "--max-logprobs",
        type=_max_logprobs,
        default=MAX_LOGPROBS,
        help=f"most logprobs / top_logprobs / prompt_logprobs a request may ask for (0 to {MAX_LOGPROBS})",
    )
    parser.add_argument(
        "--shutdown-grace",
        type=float,
        default=30.0,
        help="seconds in-flight requests may finish after SIGTERM",
    )
    parser.add_argument(
        "--headless",
        action="store_true",
        help="run only this host's data-parallel engine-core ranks (no API); the head runs the API",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument(
        "--num-threads",
        type=int,
        default=0,
        help="torch CPU threads (0: all cores but one, left to the HTTP event loop)",
    )


def _max_logprobs(text: str) -> int:
    n = int(text)
    if not 0 <= n <= MAX_LOGPROBS:
        raise argparse.ArgumentTypeError(f"must be in [0, {MAX_LOGPROBS}] (the sampler returns at most that)")
    return n
