"""The prompt of a chat request (chat completions and /tokenize): messages, tools and template options in
the checkpoint's conversation format; a 400 names the field or the message at fault."""

from __future__ import annotations

from typing import Any

from hybridserve.chat_format.deepseek_v4_history import HistoryError
from hybridserve.engine.async_llm import AsyncLLM
from hybridserve.server.errors import APIError
from hybridserve.server.protocol import ChatMessage, Tool, _ChatPromptFields
from hybridserve.server.serving import OFF_LOOP_CHARS, ServerSettings, check_text_fits, off_loop

_V4_FLAGS = ("thinking", "enable_thinking", "drop_thinking")


def _message(i: int, m: ChatMessage, v4: bool) -> dict[str, Any]:
    """A message as the format reads it: in a Jinja template ``developer`` is ``system``; DeepSeek-V4 has
    roles of its own and reads reasoning and per-message tools."""
    role = m.role if v4 or m.role != "developer" else "system"
    if m.role == "latest_reminder" and not v4:
        raise APIError(
            400, f"messages[{i}]: role latest_reminder needs --tokenizer-mode deepseek_v4", f"messages.{i}"
        )
    if m.reasoning is not None and m.reasoning_content is not None and m.reasoning != m.reasoning_content:
        raise APIError(400, f"messages[{i}]: reasoning and reasoning_content differ", f"messages.{i}")
    out: dict[str, Any] = {"role": role, "content": m.text()}
    if m.tool_calls:
        out["tool_calls"] = [c.model_dump() for c in m.tool_calls]
    pairs = [("name", m.name), ("tool_call_id", m.tool_call_id)]
    pairs.append(("reasoning_content", m.reasoning_content or m.reasoning))
    out.update({k: v for k, v in pairs if v is not None})
    if v4 and m.tools:
        out["tools"] = [_tool_dict(t, True) for t in m.tools]
    return out


def prompt_kwargs(
    body: _ChatPromptFields, settings: ServerSettings, efforts: dict[str, str] | None
) -> dict[str, Any]:
    """Template variables: the server's defaults under the request's ``chat_template_kwargs``, then
    ``reasoning_effort``, ``continue_final_message`` and ``tools``. ``efforts``: in DeepSeek-V4's format,
    its reasoning effort levels (checked here), else None."""
    v4 = efforts is not None
    kwargs = {**settings.default_chat_template_kwargs, **(body.chat_template_kwargs or {})}
    if body.reasoning_effort is not None:
        kwargs["reasoning_effort"] = body.reasoning_effort
    if body.continue_final_message:
        if body.add_generation_prompt:
            raise APIError(
                400, "continue_final_message needs add_generation_prompt false", "add_generation_prompt"
            )
        kwargs["continue_final_message"] = True
    if body.tools:
        kwargs["tools"] = [_tool_dict(t, v4) for t in body.tools]
    if efforts is not None:
        _check_v4(kwargs, body, efforts)
    return kwargs


def _tool_dict(tool: Tool, as_sent: bool) -> dict[str, Any]:
    """A tool as the client sent it (DeepSeek-V4 prints the definition's JSON), or without its nulls."""
    if as_sent:
        return {"type": "function", "function": tool.function_as_sent()}
    return tool.model_dump(exclude_none=True)


def _check_v4(kwargs: dict[str, Any], body: _ChatPromptFields, efforts: dict[str, str]) -> None:
    effort = kwargs.get("reasoning_effort")
    if effort is not None and effort not in efforts:
        where = (
            "reasoning_effort"
            if body.reasoning_effort is not None
            else "chat_template_kwargs.reasoning_effort"
        )
        levels = ", ".join(efforts)
        raise APIError(400, f"{where} must be one of {levels} (DeepSeek-V4's levels), not {effort!r}", where)
    for flag in _V4_FLAGS:
        if flag in kwargs and not isinstance(kwargs[flag], bool):
            raise APIError(
                400, f"chat_template_kwargs.{flag} must be true or false", f"chat_template_kwargs.{flag}"
            )


def v4_efforts(llm: AsyncLLM) -> dict[str, str] | None:
    """The effort levels of DeepSeek-V4's format when the model speaks it, else None."""
    tokenizer = llm.tokenizer
    return tokenizer.effort_prompts if tokenizer is not None and tokenizer.mode == "deepseek_v4" else None


async def render_messages(
    messages: list[ChatMessage], llm: AsyncLLM, add_generation_prompt: bool, **extra: Any
) -> tuple[list[int], str]:
    """Token ids and text of the conversation in the checkpoint's format; 400 when it cannot be rendered."""
    tokenizer = llm.tokenizer
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer, so chat is unavailable: use /v1/completions")
    v4 = tokenizer.mode == "deepseek_v4"
    if extra.get("continue_final_message") and messages[-1].role != "assistant":
        raise APIError(400, "continue_final_message needs an assistant message last", "messages")

    def render() -> tuple[list[int], str]:  # all of it in a worker thread when the messages are many
        rendered = [_message(i, m, v4) for i, m in enumerate(messages)]
        check_text_fits(llm, "".join(m["content"] for m in rendered), "messages")
        try:
            return tokenizer.encode_chat(rendered, add_generation_prompt, **extra)
        except HistoryError as exc:
            raise APIError(400, str(exc), param=f"messages.{exc.index}") from exc
        except Exception as exc:  # the template's raise_exception, text it cannot escape, or a template bug
            raise APIError(400, f"the messages cannot be rendered: {exc}", param="messages") from exc

    size = sum(len(m.content) if isinstance(m.content, str) else 256 for m in messages[:64])
    return await off_loop(size if len(messages) <= 64 else OFF_LOOP_CHARS + 1, render)
