"""DeepSeek-V4's conversation format, rendered as its official encoder (``encoding/encoding_dsv4.py`` in
the DeepSeek-V4 checkpoints) renders it, byte for byte, for what an OpenAI request can express.

    BOS [effort prompt] system [tools] <｜User｜>text<｜Assistant｜><think>reasoning</think>reply EOS ...

In thinking mode the prompt ends in ``<think>`` (the model reasons first), in chat mode in ``</think>``.
Reasoning of turns before the last user turn is dropped unless tools are given or ``drop_thinking`` is
off. The encoder's internal task tokens (``<｜action｜>``...) and ``response_format`` prompt are not
rendered: no OpenAI field asks for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridserve.chat_format.deepseek_v4_history import (
    Block,
    Turn,
    drop_old_reasoning,
    last_user_index,
    to_turns,
)
from hybridserve.chat_format.dsml import (
    ASSISTANT,
    BOS,
    CALLS_BEGIN,
    CALLS_END,
    END_THINK,
    EOS,
    LATEST_REMINDER,
    THINK,
    USER,
    Piece,
    call_pieces,
    tools_prompt,
)

# The reasoning effort levels DeepSeek-V4's encoder defines (thinking mode only): the text put first.
EFFORT_PROMPTS = {
    "high": "",
    "max": (
        "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
        "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve "
        "the root cause, rigorously stress-testing your logic against all potential paths, edge cases, "
        "and adversarial scenarios.\n"
        "Explicitly write out your entire deliberation process, documenting every intermediate step, "
        "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
        "unchecked.\n\n"
    ),
}
# The later encoder (the DeepSeek-V4 *-0731 checkpoints) has three levels: its "high" is the first's "max".
EFFORT_PROMPTS_0731 = {
    "low": "",
    "high": EFFORT_PROMPTS["max"],
    "max": (
        "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
        "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively "
        "decompose the problem into its most fundamental components, trace every causal chain to its root, "
        "and resolve the underlying cause rather than any surface symptom.\n"
        "Do not stop reasoning until you have independently verified the solution from multiple angles and "
        "are certain that no assumption remains unchecked and no error remains undiscovered.\n\n"
    ),
}


def effort_prompts(encoder_source: str | None) -> dict[str, str]:
    """The effort levels of the encoder a checkpoint ships (its source), the first encoder's if none."""
    return (
        EFFORT_PROMPTS_0731
        if encoder_source and "REASONING_EFFORT_PROMPTS" in encoder_source
        else EFFORT_PROMPTS
    )


@dataclass(frozen=True)
class RenderOptions:
    thinking: bool = True
    reasoning_effort: str | None = None  # a key of efforts
    efforts: dict[str, str] | None = None  # the encoder's effort levels (None: EFFORT_PROMPTS)
    drop_thinking: bool = True
    add_generation_prompt: bool = True  # after a final user turn: <｜Assistant｜> and the mode's tag
    continue_final_message: bool = False  # a final assistant turn is left open (no EOS)


def render(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, options: RenderOptions
) -> list[Piece]:
    """The prompt as pieces whose texts join to it; ValueError (HistoryError) for what cannot be rendered."""
    efforts = options.efforts or EFFORT_PROMPTS
    if options.reasoning_effort is not None and options.reasoning_effort not in efforts:
        raise ValueError(f"reasoning_effort must be one of {', '.join(efforts)}")
    turns = _with_tools(to_turns(messages), [t["function"] for t in tools or []])
    drop = options.drop_thinking and not any(t.tools for t in turns)
    if options.thinking and drop:
        turns = drop_old_reasoning(turns)
    renderer = _Renderer(turns, options, drop)
    pieces: list[Piece] = [(BOS, False)]
    for k in range(len(turns)):
        pieces += renderer.turn(k)
    return [p for p in pieces if p[0]]


def _with_tools(turns: list[Turn], functions: list[dict[str, Any]]) -> list[Turn]:
    """Request tools go to a leading system or developer turn, else to a system turn put first (as vLLM)."""
    if not functions:
        return turns
    if turns and turns[0].role in ("system", "developer"):
        turns[0].tools = functions
        return turns
    return [Turn("system", tools=functions), *turns]


@dataclass
class _Renderer:
    turns: list[Turn]
    options: RenderOptions
    drop: bool  # reasoning of earlier turns is dropped

    def turn(self, k: int) -> list[Piece]:
        t = self.turns[k]
        pieces: list[Piece] = []
        effort = self.options.reasoning_effort
        if k == 0 and self.options.thinking and effort is not None:
            pieces.append(((self.options.efforts or EFFORT_PROMPTS)[effort], False))
        if t.role == "system":
            pieces += [(t.content, True), *self._tools(t)]
        elif t.role == "developer":
            pieces += [(USER, False), (t.content, True), *self._tools(t)]
        elif t.role == "user":
            pieces += [(USER, False), *_blocks(t.blocks)]
        elif t.role == "latest_reminder":
            pieces += [(LATEST_REMINDER, False), (t.content, True)]
        else:
            pieces += self._assistant(k, t)
        return pieces + self._transition(k)

    def _tools(self, t: Turn) -> list[Piece]:
        return [("\n\n", False), *tools_prompt(t.tools)] if t.tools else []

    def _assistant(self, k: int, t: Turn) -> list[Piece]:
        pieces: list[Piece] = []
        if self.options.thinking and (not self.drop or k > self._last_user):
            pieces += [(t.reasoning or "", True), (END_THINK, False)]
        pieces.append((t.content, True))
        if t.calls:
            pieces.append((f"\n\n{CALLS_BEGIN}\n", False))
            for n, call in enumerate(t.calls):
                pieces += [("\n" if n else "", False), *call_pieces(call.name, call.arguments)]
            pieces.append((f"\n{CALLS_END}", False))
        is_open = self.options.continue_final_message and k == len(self.turns) - 1
        return pieces if is_open else [*pieces, (EOS, False)]

    def _transition(self, k: int) -> list[Piece]:
        """After a user or developer turn that the assistant answers: <｜Assistant｜> and the mode's tag."""
        t, last = self.turns[k], k == len(self.turns) - 1
        if not last and self.turns[k + 1].role not in ("assistant", "latest_reminder"):
            return []
        if t.role not in ("user", "developer") or (last and not self.options.add_generation_prompt):
            return []
        open_thinking = self.options.thinking and (not self.drop or k >= self._last_user)
        return [(ASSISTANT, False), (THINK if open_thinking else END_THINK, False)]

    @property
    def _last_user(self) -> int:
        return last_user_index(self.turns)


def _blocks(blocks: list[Block]) -> list[Piece]:
    pieces: list[Piece] = []
    for n, b in enumerate(blocks):
        pieces.append(("\n\n" if n else "", False))
        pieces += [("<tool_result>", False), (b.text, True), ("</tool_result>", False)] if b.is_result else []
        pieces += [] if b.is_result else [(b.text, True)]
    return pieces


def prompt_text(pieces: list[Piece]) -> str:
    return "".join(text for text, _ in pieces)


def options_from(
    kwargs: dict[str, Any], add_generation_prompt: bool = True, efforts: dict[str, str] | None = None
) -> RenderOptions:
    """Render options from chat template kwargs: ``thinking`` (or ``enable_thinking``; on unless either is
    given, as vLLM), ``reasoning_effort``, ``drop_thinking``, ``continue_final_message``."""
    if "thinking" in kwargs or "enable_thinking" in kwargs:
        thinking = bool(kwargs.get("thinking")) or bool(kwargs.get("enable_thinking"))
    else:
        thinking = True
    return RenderOptions(
        thinking=thinking,
        reasoning_effort=kwargs.get("reasoning_effort"),
        efforts=efforts,
        drop_thinking=bool(kwargs.get("drop_thinking", True)),
        add_generation_prompt=add_generation_prompt,
        continue_final_message=bool(kwargs.get("continue_final_message", False)),
    )
