"""OpenAI-style messages as DeepSeek-V4's turns: tool results merged into the user turn that follows the
calls, in call order; malformed history named by its message index."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")


class HistoryError(ValueError):
    """A message the format cannot express; ``index`` is its place in the request's messages."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(f"messages[{index}]: {message}")
        self.index = index


@dataclass(frozen=True)
class Call:
    id: str
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Block:
    """A part of a user turn: the user's text, or a tool's result (``call_id`` names the call)."""

    text: str
    call_id: str | None = None

    @property
    def is_result(self) -> bool:
        return self.call_id is not None


@dataclass
class Turn:
    role: str  # one of ROLES but "tool"
    content: str = ""
    reasoning: str | None = None
    calls: list[Call] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)  # user turns
    tools: list[dict[str, Any]] | None = None  # function definitions shown in this turn


def to_turns(messages: list[dict[str, Any]]) -> list[Turn]:
    """Messages (``role``, ``content``, ``reasoning_content``, ``tool_calls``, ``tool_call_id`` and, on system
    or developer messages, ``tools`` shown there) as turns."""
    turns: list[Turn] = []
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content") or ""
        if role not in ROLES:
            raise HistoryError(i, f"role {role!r} is not one of {', '.join(ROLES)}")
        if role == "tool":
            _check_result(i, m, messages)
            _add_block(turns, Block(content, str(m.get("tool_call_id") or "")))
        elif role == "user":
            _add_block(turns, Block(content))
        elif role == "developer" and not content:
            raise HistoryError(i, "a developer message needs content")
        else:
            calls = [_call(i, c) for c in m.get("tool_calls") or []] if role == "assistant" else []
            functions = [t["function"] for t in m.get("tools") or []] or None
            reasoning = m.get("reasoning_content", m.get("reasoning"))  # DeepSeek's name, or vLLM's
            turns.append(Turn(role, content, reasoning, calls, tools=functions))
    return _in_call_order(turns)


def _add_block(turns: list[Turn], block: Block) -> None:
    """Consecutive user messages and tool results make one user turn."""
    if turns and turns[-1].role == "user":
        turns[-1].blocks.append(block)
    else:
        turns.append(Turn("user", blocks=[block]))


def _check_result(i: int, m: dict[str, Any], messages: list[dict[str, Any]]) -> None:
    before = next((p for p in reversed(messages[:i]) if p.get("role") != "tool"), None)
    if before is None or before.get("role") != "assistant" or not before.get("tool_calls"):
        raise HistoryError(i, "a tool message must answer an assistant message's tool_calls")
    ids = {c.get("id") for c in before["tool_calls"] if c.get("id")}
    call_id = m.get("tool_call_id")
    if call_id and ids and call_id not in ids:
        raise HistoryError(i, f"tool_call_id {call_id!r} names none of the calls before it")


def _call(i: int, call: dict[str, Any]) -> Call:
    fn = call.get("function") or {}
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            args = {"arguments": args}  # as DeepSeek's encoder keeps arguments that are not JSON
    if not isinstance(args, dict):
        raise HistoryError(i, f"the arguments of tool call {fn.get('name')!r} must be a JSON object")
    return Call(str(call.get("id") or ""), str(fn.get("name", "")), args)


def _in_call_order(turns: list[Turn]) -> list[Turn]:
    """Tool results of a user turn sorted by the order of the calls in the last assistant turn with calls."""
    order: dict[str, int] = {}
    for turn in turns:
        if turn.calls:
            order = {c.id: k for k, c in enumerate(turn.calls) if c.id}
        results = [b for b in turn.blocks if b.is_result]
        if len(results) > 1 and order:
            ranked = iter(sorted(results, key=lambda b: order.get(b.call_id or "", 0)))
            turn.blocks = [next(ranked) if b.is_result else b for b in turn.blocks]
    return turns


def drop_old_reasoning(turns: list[Turn]) -> list[Turn]:
    """Before the last user turn: assistant turns lose their reasoning and developer turns go."""
    last = last_user_index(turns)
    kept = []
    for k, t in enumerate(turns):
        if k >= last or t.role in ("user", "system", "latest_reminder"):
            kept.append(t)
        elif t.role == "assistant":
            kept.append(replace(t, reasoning=None))
    return kept


def last_user_index(turns: list[Turn]) -> int:
    return max((k for k, t in enumerate(turns) if t.role in ("user", "developer")), default=-1)
