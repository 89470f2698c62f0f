"""DeepSeek-V4's markers and the DSML text it uses for tools: the tools prompt and a past tool call.

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

A string value is written as is (``string="true"``); any other value as JSON (``string="false"``).
"""

from __future__ import annotations

import json
from typing import Any

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK = "<think>"
END_THINK = "</think>"
DSML = "｜DSML｜"
CALLS_BEGIN, CALLS_END = f"<{DSML}tool_calls>", f"</{DSML}tool_calls>"
INVOKE_BEGIN, INVOKE_END = f'<{DSML}invoke name="', f"</{DSML}invoke>"
PARAM_BEGIN, PARAM_END = f'<{DSML}parameter name="', f"</{DSML}parameter>"

TOOLS_PROMPT = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "{CALLS_BEGIN}" block like the following:

{CALLS_BEGIN}
{INVOKE_BEGIN}$TOOL_NAME">
{PARAM_BEGIN}$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{PARAM_END}
...
{INVOKE_END}
{INVOKE_BEGIN}$TOOL_NAME2">
...
{INVOKE_END}
{CALLS_END}

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK}), you MUST output your complete reasoning inside {THINK}...{END_THINK} BEFORE any tool calls or final response.

Otherwise, output directly after {END_THINK} with tool calls or final response.

### Available Tool Schemas

"""  # noqa: E501 (the model was trained on these exact lines)
TOOLS_PROMPT_END = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)

Piece = tuple[str, bool]  # (text, whether it is the client's text: never read as special tokens)


def to_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def tools_prompt(functions: list[dict[str, Any]]) -> list[Piece]:
    """The tools section: the fixed instructions, then one JSON line per function definition."""
    schemas = "\n".join(to_json(f) for f in functions)
    return [(TOOLS_PROMPT, False), (schemas, True), (TOOLS_PROMPT_END, False)]


def call_pieces(name: str, arguments: dict[str, Any]) -> list[Piece]:
    """One past call as the model writes it (an ``invoke`` element with a line per argument)."""
    pieces: list[Piece] = [(INVOKE_BEGIN, False), (name, True), ('">\n', False)]
    for k, (key, value) in enumerate(arguments.items()):
        is_str = isinstance(value, str)
        pieces += [("\n" if k else "", False), (PARAM_BEGIN, False), (key, True)]
        pieces += [(f'" string="{"true" if is_str else "false"}">', False)]
        pieces += [(value if is_str else to_json(value), True), (PARAM_END, False)]
    return [*pieces, (f"\n{INVOKE_END}", False)]
