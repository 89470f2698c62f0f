"""``POST /v1/responses`` requests (OpenAI's Responses API) as the chat requests they amount to: input
items become messages, function tools chat tools. Nothing is stored: ``store`` must be false."""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError

from hybridserve.server.errors import APIError
from hybridserve.server.protocol import ChatCompletionRequest, ChatMessage, _Strict


class ResponsesRequest(_Strict):
    model: str
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = Field(None, max_length=128)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    store: bool | None = None
    reasoning: dict[str, Any] | None = None
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # as in chat completions (vLLM's extension)
    guided_regex: str | None = None  # the same
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}


def to_chat(body: ResponsesRequest, efforts: dict[str, str] | None) -> ChatCompletionRequest:
    """The chat request ``body`` amounts to; 400 naming the field or input item it cannot take.
    ``efforts``: DeepSeek-V4's reasoning effort levels when the model speaks its format, else None."""
    if body.store:
        raise APIError(400, "this server stores no responses: send store false", param="store")
    if body.previous_response_id is not None:
        raise APIError(
            400, "no response is stored: send the whole conversation as input", "previous_response_id"
        )
    messages = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    messages += _messages(body.input)
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": [_checked(ChatMessage, m, f"input.{m.pop('_at', 0)}") for m in messages],
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "stream": body.stream,
        "parallel_tool_calls": body.parallel_tool_calls,
        "chat_template_kwargs": body.chat_template_kwargs,
        "reasoning_effort": _effort(body.reasoning, efforts),
        "guided_regex": body.guided_regex,
        "response_format": _response_format(body.text),
    }
    if body.tools:
        fields["tools"] = [_tool(k, t) for k, t in enumerate(body.tools)]
    if body.tool_choice is not None:
        fields["tool_choice"] = _tool_choice(body.tool_choice)
    return _checked(ChatCompletionRequest, fields, "tool_choice", located=True)


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (whose json_schema nests what Responses puts flat)."""
    fmt = dict((text or {}).get("format") or {})
    if fmt.get("type") != "json_schema":
        return fmt or None
    keys = ("name", "description", "schema", "strict")
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in keys if k in fmt}}


def _checked(model: Any, fields: dict[str, Any], param: str, located: bool = False) -> Any:
    """``model(**fields)``; a 400 naming ``param``, or with ``located`` the Responses field at fault (a
    check of the whole request, such as tool_choice naming a tool, names ``param``)."""
    try:
        return model(**fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        if located and first["loc"]:
            param = _RESPONSES_NAMES.get(str(first["loc"][0]), str(first["loc"][0]))
        raise APIError(400, f"{param}: {first['msg']}", param=param) from exc


_RESPONSES_NAMES = {"response_format": "text.format", "max_tokens": "max_output_tokens"}


def _effort(reasoning: dict[str, Any] | None, efforts: dict[str, str] | None) -> str | None:
    effort = (reasoning or {}).get("effort")
    if effort is None or efforts is None:
        return None
    if effort not in efforts:
        levels = ", ".join(efforts)
        raise APIError(400, f"reasoning.effort must be one of {levels}, not {effort!r}", "reasoning.effort")
    return str(effort)


def _tool(k: int, tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function" or not tool.get("name"):
        raise APIError(400, "only function tools (type function, with a name) are served", f"tools.{k}")
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}  # as sent


def _tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages (each tagged ``_at`` with its item index): a reasoning item goes with
    the assistant turn after it, function calls join the assistant message before them."""
    if isinstance(items, str):
        return [{"role": "user", "content": items, "_at": 0}]
    out: list[dict[str, Any]] = []
    reasoning: str | None = None
    for k, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "reasoning":
            reasoning = "".join(_texts(item.get("content") or item.get("summary") or [], k))
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function"}
            call["function"] = {"name": item.get("name"), "arguments": item.get("arguments", "{}")}
            if not (out and out[-1]["role"] == "assistant" and out[-1]["_open"]):
                out.append({"role": "assistant", "content": None, "_open": True, "_at": k})
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            out.append(
                {"role": "tool", "tool_call_id": item.get("call_id"), "content": item.get("output"), "_at": k}
            )
        elif kind == "message":
            message = {"role": item.get("role"), "content": _content(item.get("content"), k), "_at": k}
            message["_open"] = item.get("role") == "assistant"
            out.append(message)
        else:
            raise APIError(400, f"input item of type {kind!r} is not served", param=f"input.{k}")
        if kind in ("message", "function_call") and out[-1]["role"] == "assistant" and reasoning is not None:
            out[-1]["reasoning_content"], reasoning = reasoning, None
    for m in out:
        m.pop("_open", None)
    return out


def _content(content: Any, k: int) -> str:
    return content if isinstance(content, str) else "".join(_texts(content or [], k))


def _texts(parts: Any, k: int) -> list[str]:
    texts = [p.get("text") for p in parts if isinstance(p, dict)] if isinstance(parts, list) else []
    if not isinstance(parts, list) or len(texts) != len(parts) or not all(isinstance(t, str) for t in texts):
        raise APIError(400, "content must be text or text parts ({'type': ..., 'text': ...})", f"input.{k}")
    return [str(t) for t in texts]
