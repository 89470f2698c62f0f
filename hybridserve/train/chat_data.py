"""Short synthetic conversations for the chat fine-tune, rendered by our DeepSeek-V4 encoder.

With tools (in the system prompt): one to three rounds, each a user request and either a tool call in
DSML, the tool's result and a short answer that reports it, or a plain answer; the last round may stop
after the call. Without tools: one request and a plain answer. Each in chat mode or thinking mode (every
assistant turn starts with a closed ``<think>`` block). Plain answers are sentences of the Austen corpus
that name whom the user asked about. Every assistant turn is a training target: many targets share one
rendering of the long tools prompt.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hybridserve.tokenizer import Tokenizer
from hybridserve.train.chat_tools import NAMES, TOOLS, Tool, ToolUse

SYSTEMS = ("", "", "You are a helpful assistant.", "You are a helpful assistant. Answer briefly.")
TOOLS_SHARE = 0.7  # conversations with tools given
CALL_SHARE = 0.8  # rounds of a tools conversation that call a tool
THINKING_SHARE = 0.4
_SENTENCE = re.compile(r"[^.!?\n]{30,160}[.!?]")


@dataclass(frozen=True)
class ChatExample:
    ids: list[int]
    targets: list[tuple[int, int]]  # [start, end) of each assistant turn's tokens (EOS included)
    has_tools: bool
    thinking: bool


def sentences_by_name(texts: Sequence[str]) -> dict[str, list[str]]:
    """Corpus sentences that name one of ``NAMES``, by name."""
    found: dict[str, list[str]] = {n: [] for n in NAMES}
    for text in texts:
        for m in _SENTENCE.finditer(text):
            sentence = m.group(0).strip()
            for name in NAMES:
                if re.search(rf"\b{name}\b", sentence):
                    found[name].append(sentence)
    return {n: s for n, s in found.items() if s}


@dataclass
class ChatMaker:
    """Draws conversations (OpenAI messages + tools) and renders them to ``ChatExample``."""

    tokenizer: Tokenizer  # in deepseek_v4 mode
    sentences: dict[str, list[str]]
    rng: random.Random

    def example(self) -> ChatExample:
        thinking = self.rng.random() < THINKING_SHARE
        system = self.rng.choice(SYSTEMS)
        head = [{"role": "system", "content": system}] if system else []
        if self.rng.random() >= TOOLS_SHARE:
            return self.render([*head, *self._chat(thinking)], [], thinking)
        tools = self.rng.sample(TOOLS, self.rng.choice((1, 2, 2, 3)))
        rounds = self.rng.choice((1, 1, 2, 3))
        messages = head
        for k in range(rounds):
            use_tool = self.rng.random() < CALL_SHARE
            messages += self._tool_round(tools, thinking, k, last=k == rounds - 1) if use_tool else []
            messages += [] if use_tool else self._chat(thinking)
        return self.render(messages, tools, thinking)

    def _tool_round(self, tools: list[Tool], thinking: bool, k: int, last: bool) -> list[dict[str, Any]]:
        """A request, the call; unless the conversation may stop here, the result and the answer."""
        tool = self.rng.choice(tools)
        use = tool.draw(self.rng)
        call_id = f"call_{k}"
        messages = [
            {"role": "user", "content": use.request},
            _call_message(tool.name, use, thinking, call_id),
        ]
        if last and self.rng.random() < 0.5:
            return messages
        result = json.dumps(use.result)
        reply = _reply(use.answer, f"The tool gives {result}. I will tell the user.", thinking)
        return [*messages, {"role": "tool", "tool_call_id": call_id, "content": result}, reply]

    def _chat(self, thinking: bool) -> list[dict[str, Any]]:
        name = self.rng.choice(sorted(self.sentences))
        question = self.rng.choice(
            ("Tell me about {n}.", "What do you know of {n}?", "Say something of {n}.")
        )
        reasoning = f"The user asks about {name}. I will answer with a line about {name}."
        answer = _reply(self.rng.choice(self.sentences[name]), reasoning, thinking)
        return [{"role": "user", "content": question.format(n=name)}, answer]

    def render(self, messages: list[dict[str, Any]], tools: list[Tool], thinking: bool) -> ChatExample:
        """Token ids of the conversation and the span of every assistant turn, found by rendering the
        conversation up to each (with the generation prompt) and through it."""
        extra: dict[str, Any] = {"thinking": thinking}
        if tools:
            extra["tools"] = [t.definition() for t in tools]
        ids, _ = self.tokenizer.encode_chat(messages, False, **extra)
        targets = []
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                before = self.tokenizer.encode_chat(messages[:i], True, **extra)[0]
                through = self.tokenizer.encode_chat(messages[: i + 1], False, **extra)[0]
                if ids[: len(through)] != through or through[: len(before)] != before:
                    raise ValueError(f"messages[{i}]: the conversation's tokens do not extend its prompt's")
                targets.append((len(before), len(through)))
        return ChatExample(ids, targets, bool(tools), thinking)


def _call_message(name: str, use: ToolUse, thinking: bool, call_id: str) -> dict[str, Any]:
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(use.arguments)},
    }
    reasoning = f"The user wants {use.purpose}. I will call {name}."
    return {**_reply("", reasoning, thinking), "tool_calls": [call]}


def _reply(content: str, reasoning: str, thinking: bool) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    return {**message, "reasoning_content": reasoning} if thinking else message
