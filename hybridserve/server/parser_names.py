"""The output parsers' names (``--reasoning-parser``, ``--tool-call-parser``), apart so flags load fast."""

REASONING_PARSERS = ("deepseek_v4", "deepseek_r1", "deepseek_v3")  # all end the reasoning at </think>
TOOL_CALL_PARSERS = ("deepseek_v31", "deepseek_v4")
