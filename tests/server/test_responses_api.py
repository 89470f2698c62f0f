"""POST /v1/responses through the official openai client: text and items in; reasoning, message and
function_call items out, whole and as streaming events; nothing stored. On the bundled model in
--tokenizer-mode deepseek_v4 with its reasoning and tool-call parsers."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from hybridserve.chat_format.deepseek_v4 import EFFORT_PROMPTS
from hybridserve.server.errors import APIError
from hybridserve.server.responses_input import ResponsesRequest, to_chat
from tests.server.conftest import API_KEY, Server, stop_server
from tests.server.deepseek_v4_server import DSML_CALL, literal, start_v4_server

TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"],
    },
}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = start_v4_server("--max-num-seqs", "4")
    yield s
    assert stop_server(s) == 0


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_text_input_gives_a_message(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model="austen",
        input="Hello",
        max_output_tokens=6,
        extra_body={"chat_template_kwargs": {"thinking": False}},
    )
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in r.output] == ["message"] and r.output_text
    assert r.usage is not None and r.usage.output_tokens == 6 and r.usage.input_tokens > 0


def test_reasoning_and_a_function_call_whole_and_streamed(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model="austen",
        input=[{"role": "user", "content": "Weather in Bath?"}],
        tools=[TOOL],
        max_output_tokens=400,
        extra_body={"guided_regex": literal("I should call the tool.</think>" + DSML_CALL)},
    )
    r = client.responses.create(**kwargs)
    assert r.status == "completed"
    assert [item.type for item in r.output] == ["reasoning", "function_call"]
    reasoning, call = r.output
    assert reasoning.content is not None and reasoning.content[0].text == "I should call the tool."
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Bath", "days": 3}
    assert call.call_id.startswith("call_")

    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    arguments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert (
        thought == "I should call the tool." and len(arguments) > 1 and "".join(arguments) == call.arguments
    )
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "function_call"]
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "function_call"]


def test_a_tool_loop_with_function_call_outputs(client: openai.OpenAI) -> None:
    items: list[Any] = [
        {"role": "user", "content": "Weather in Bath?"},
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "Tool."}],
        },
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Bath", "days": 1}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 22 C"},
    ]
    events = list(
        client.responses.create(model="austen", input=items, tools=[TOOL], max_output_tokens=12, stream=True)
    )
    assert events[-1].type in ("response.completed", "response.incomplete")


def test_items_become_the_chat_messages_they_amount_to() -> None:
    body = ResponsesRequest(
        model="m",
        instructions="Be brief.",
        input=[
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            {"type": "reasoning", "id": "rs", "summary": [{"type": "summary_text", "text": "think"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "one"},
            {"type": "function_call_output", "call_id": "c2", "output": "two"},
        ],
        tools=[{**TOOL, "name": "f"}, {**TOOL, "name": "g"}],
        tool_choice={"type": "function", "name": "g"},
        reasoning={"effort": "max"},
    )
    chat = to_chat(body, EFFORT_PROMPTS)
    assert [(m.role, m.text()) for m in chat.messages] == [
        ("system", "Be brief."),
        ("user", "Hi"),
        ("assistant", ""),
        ("tool", "one"),
        ("tool", "two"),
    ]
    assistant = chat.messages[2]
    assert assistant.reasoning_content == "think" and [c.id for c in assistant.tool_calls or []] == [
        "c1",
        "c2",
    ]
    assert chat.reasoning_effort == "max" and chat.tools and chat.tools[1].function.name == "g"


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": [{"type": "web_search_call"}]}, "input.0"),
        ({"tools": [{"type": "web_search"}]}, "tools.0"),
        ({"reasoning": {"effort": "low"}}, "reasoning.effort"),
        ({"text": {"format": {"type": "json_schema"}}}, "text.format"),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ],
)
def test_what_is_not_served_is_a_400_naming_it(server: Server, change: dict[str, Any], param: str) -> None:
    body = {"model": "austen", "input": "Hi", "max_output_tokens": 2, **change}
    r = httpx.post(f"{server.url}/v1/responses", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_text_format_is_the_chat_response_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "name": "x", "schema": schema, "strict": True}
    chat = to_chat(ResponsesRequest(model="m", input="Hi", text={"format": fmt}), None)
    assert chat.response_format is not None and chat.response_format.json_schema is not None
    assert chat.response_format.json_schema.schema_ == schema
    plain = to_chat(ResponsesRequest(model="m", input="Hi", text={"format": {"type": "text"}}), None)
    assert plain.response_format is not None and plain.response_format.type == "text"


_JSON = st.recursive(
    st.integers() | st.booleans() | st.text(max_size=5) | st.none(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
_KEYS = st.sampled_from(
    ["type", "role", "content", "text", "call_id", "name", "arguments", "output", "summary"]
)
_ITEM = st.one_of(
    st.dictionaries(_KEYS, _JSON | st.sampled_from(["message", "user", "function_call", "reasoning"])),
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]), "content": _JSON}),
    st.fixed_dictionaries({"type": st.just("reasoning"), "content": _JSON, "summary": _JSON}),
    st.fixed_dictionaries(
        {"type": st.just("function_call"), "call_id": _JSON, "name": _JSON, "arguments": _JSON}
    ),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": _JSON, "output": _JSON}),
)


@settings(max_examples=300, deadline=None)
@given(
    items=st.lists(_ITEM, min_size=1, max_size=4),
    extra=st.dictionaries(
        st.sampled_from(["tools", "tool_choice", "text", "reasoning", "instructions"]), _JSON, max_size=2
    ),
)
def test_any_input_is_a_chat_request_or_a_400(items: list[dict[str, Any]], extra: dict[str, Any]) -> None:
    try:
        body = ResponsesRequest(model="m", input=items, **extra)
    except ValidationError:  # FastAPI answers these with a 400 before the handler runs
        body = ResponsesRequest(model="m", input=items)
    try:
        to_chat(body, EFFORT_PROMPTS)
    except APIError as exc:
        assert exc.status == 400 and exc.param
