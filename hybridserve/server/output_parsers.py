"""What a chat answer is read for: reasoning (``--reasoning-parser``) and tool calls (``--tool-call-parser``
and ``--enable-auto-tool-choice``, vLLM's flags), streamed or whole."""

from __future__ import annotations

from dataclasses import dataclass

from hybridserve.server.dsml_tool_calls import DsmlToolParser, parse_dsml
from hybridserve.server.errors import APIError
from hybridserve.server.protocol import ChatCompletionRequest, ToolCallDelta, ToolCallOut
from hybridserve.server.reasoning import ReasoningParser, split_reasoning
from hybridserve.server.serving import ServerSettings
from hybridserve.server.tool_calls import StreamingToolParser, parse_tool_calls

STRUCTURAL_TAGS = {"deepseek_v31": "deepseek_v3_1", "deepseek_v4": "deepseek_v4"}  # xgrammar's names


def tool_parser_name(settings: ServerSettings, tokenizer_mode: str) -> str:
    """The named parser, else the format's own: DSML for DeepSeek-V4's encoder, V3.1's for templates."""
    return settings.tool_call_parser or ("deepseek_v4" if tokenizer_mode == "deepseek_v4" else "deepseek_v31")


def reads_tools(body: ChatCompletionRequest, settings: ServerSettings) -> bool:
    """Tools given and ``tool_choice`` not ``none``. With a parser named on the command line, ``auto``
    needs ``--enable-auto-tool-choice`` (as in vLLM); without one, hybridserve reads calls in any case."""
    if not body.tools or body.tool_choice == "none":
        return False
    if (
        body.tool_choice in (None, "auto")
        and settings.tool_call_parser
        and not settings.enable_auto_tool_choice
    ):
        if body.tool_choice == "auto":
            message = 'tool_choice "auto" needs the server started with --enable-auto-tool-choice'
            raise APIError(400, message, param="tool_choice")
        return False
    return True


@dataclass
class ChatOutputParser:
    """One choice's text deltas -> (reasoning, content, tool call deltas)."""

    reasoning: ReasoningParser | None
    tools: StreamingToolParser | DsmlToolParser | None

    def feed(self, delta: str, final: bool) -> tuple[str, str, list[ToolCallDelta]]:
        reasoning, content = self.reasoning.feed(delta, final) if self.reasoning else ("", delta)
        if self.tools is None:
            return reasoning, content, []
        content, calls = self.tools.feed(content, final)
        return reasoning, content, calls

    @property
    def made_calls(self) -> bool:
        return bool(self.tools.completed) if self.tools is not None else False


@dataclass(frozen=True)
class OutputReading:
    """How a request's answer is read: whether for reasoning, and the tool-call parser if any."""

    prompt: str
    reasoning: bool
    tool_parser: str | None

    def stream_parser(self) -> ChatOutputParser:
        reasoning = ReasoningParser.for_prompt(self.prompt) if self.reasoning else None
        tools: StreamingToolParser | DsmlToolParser | None = None
        if self.tool_parser is not None:
            tools = DsmlToolParser() if self.tool_parser == "deepseek_v4" else StreamingToolParser()
        return ChatOutputParser(reasoning, tools)

    def whole(self, text: str) -> tuple[str | None, str | None, list[ToolCallOut]]:
        """(reasoning, content, completed calls) of a whole answer."""
        reasoning, content = split_reasoning(self.prompt, text) if self.reasoning else (None, text)
        if self.tool_parser is None or content is None:
            return reasoning, content, []
        parse = parse_dsml if self.tool_parser == "deepseek_v4" else parse_tool_calls
        content, calls = parse(content)
        return reasoning, content, calls
