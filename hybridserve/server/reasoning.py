"""``--reasoning-parser deepseek_v4``: the output's reasoning split from its answer at ``</think>``.

In thinking mode the prompt ends in ``<think>``, so the output begins inside the reasoning; in chat mode
(the prompt ends in ``</think>``) it is all answer. The boundary token is never shown.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridserve.chat_format.dsml import END_THINK, THINK
from hybridserve.server.tool_calls import partial_suffix


@dataclass
class ReasoningParser:
    """Feeds on text deltas; -> (reasoning delta, content delta). Text that may be the start of
    ``</think>`` is held back until it is known not to be."""

    in_reasoning: bool
    buffer: str = ""
    at_start: bool = True
    ended: bool = False  # ``</think>`` came

    @classmethod
    def for_prompt(cls, prompt: str) -> ReasoningParser:
        return cls(in_reasoning=prompt.endswith(THINK))

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        if not self.in_reasoning:
            return "", delta
        self.buffer += delta
        if self.at_start:  # a model may open its reasoning once more
            if THINK.startswith(self.buffer) and not final and self.buffer != THINK:
                return "", ""
            self.buffer, self.at_start = self.buffer.removeprefix(THINK), False
        end = self.buffer.find(END_THINK)
        if end >= 0:
            reasoning, content = self.buffer[:end], self.buffer[end + len(END_THINK) :]
            self.buffer, self.in_reasoning, self.ended = "", False, True
            return reasoning, content
        keep = 0 if final else partial_suffix(self.buffer, END_THINK)
        reasoning, self.buffer = (
            self.buffer[: len(self.buffer) - keep],
            self.buffer[len(self.buffer) - keep :],
        )
        return reasoning, ""


def split_reasoning(prompt: str, text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole output; content None while the reasoning never ended."""
    parser = ReasoningParser.for_prompt(prompt)
    reasoning, content = parser.feed(text, final=True)
    if not parser.ended and prompt.endswith(THINK):
        return reasoning, None
    return reasoning or None, content or None
