"""A server of the bundled model speaking DeepSeek-V4's format, its parsers on (the tools prompt needs the
bundled model's context; the tiny models' is too short)."""

from __future__ import annotations

from pathlib import Path

from tests.server.conftest import API_KEY, Server, start_server

BUNDLED = Path(__file__).resolve().parents[2] / "hybridserve" / "assets" / "austen-v4"
V4_FLAGS = (
    *("--api-key", API_KEY, "--served-model-name", "austen", "--tokenizer-mode", "deepseek_v4"),
    *("--reasoning-parser", "deepseek_v4", "--tool-call-parser", "deepseek_v4", "--enable-auto-tool-choice"),
    *("--max-num-batched-tokens", "256", "--block-tokens", "16"),
)


def start_v4_server(*extra: str) -> Server:
    s = start_server(BUNDLED, *V4_FLAGS, *extra)
    s.model = "austen"
    return s


DSML_CALL = (
    "\n\n<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Bath</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>"
)
# DSML_CALL and its EOS are 69 tokens of the bundled tokenizer (175 before it had DeepSeek-V4's tokens)
MAX_CALL_TOKENS = 70


def literal(text: str) -> str:
    """``text`` as a regex that matches only it."""
    return "".join("\\" + c if c in ".^$*+?()[]{}|\\/" else "\\n" if c == "\n" else c for c in text)
