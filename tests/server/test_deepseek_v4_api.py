"""DeepSeek-V4's format served: DeepSeek's encoder vectors through /tokenize and /detokenize, forced output
read back as reasoning and DSML tool calls (streamed and not), and the 400s of bad chat fields. On the
bundled model (its context fits the tools prompt), in --tokenizer-mode deepseek_v4."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from hybridserve.train.chat_eval import SYSTEM
from hybridserve.train.chat_tools import TOOLS
from tests.server.conftest import API_KEY, Server, stop_server
from tests.server.deepseek_v4_server import DSML_CALL, literal, start_v4_server

VECTORS = Path(__file__).resolve().parents[1] / "chat_format" / "data" / "deepseek_v4_encoder_vectors.json"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# A call the model writes itself: DSML_CALL (69 tokens with its EOS) has two short values, and each digit of a
# number is a token; the model's numbers are often longer than the request's (model card), e.g. 539 and 239
# for "Add 12 and 30." make 73 tokens. A call that spelled DSML's markers out would take 175.
MODEL_CALL_TOKENS = 80
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer"}},
            "required": ["city", "days"],
        },
    },
}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    """Overrides the package's tiny-model server: the tools prompt needs the bundled model's context."""
    s = start_v4_server("--max-num-seqs", "8", "--default-chat-template-kwargs", '{"thinking": false}')
    yield s
    assert stop_server(s) == 0


def _post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": "austen", **body}, headers=AUTH, timeout=120)


def _stream(server: Server, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks = []
    with httpx.stream(
        "POST",
        f"{server.url}/v1/chat/completions",
        json={"model": "austen", **body, "stream": True},
        headers=AUTH,
        timeout=120,
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def _prompt_text(server: Server, body: dict[str, Any]) -> str:
    tokens = _post(server, "/tokenize", body).json()["tokens"]
    return str(_post(server, "/detokenize", {"tokens": tokens}).json()["prompt"])


@pytest.mark.parametrize("case", json.loads(VECTORS.read_text())["cases"], ids=lambda c: c["name"][:1])
def test_deepseek_vectors_through_tokenize_and_detokenize(server: Server, case: dict[str, Any]) -> None:
    assert _prompt_text(server, case["request"]) == case["prompt"]
    renamed = [  # vLLM's name for a past answer's reasoning gives the same prompt
        {("reasoning" if k == "reasoning_content" else k): v for k, v in m.items()}
        for m in case["request"]["messages"]
    ]
    assert _prompt_text(server, {**case["request"], "messages": renamed}) == case["prompt"]


def test_tokenize_takes_the_chat_fields(server: Server) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    assert _prompt_text(server, body).endswith(
        "<｜User｜>Hi<｜Assistant｜></think>Hel"
    )  # the server's default
    think = {"thinking": True}
    think_text = _prompt_text(
        server, {"messages": messages[:1], "reasoning_effort": "max", "chat_template_kwargs": think}
    )
    assert think_text.startswith("<｜begin▁of▁sentence｜>Reasoning Effort: Absolute maximum")
    assert think_text.endswith("<｜Assistant｜><think>")
    alias = _prompt_text(
        server, {"messages": messages[:1], "chat_template_kwargs": {"enable_thinking": True}}
    )
    assert alias.endswith("<｜Assistant｜><think>")
    tools = _prompt_text(server, {"messages": messages[:1], "tools": [WEATHER]})
    assert '\n{"name": "get_weather", "description": "The weather in a city"' in tools
    as_sent = {
        "type": "function",
        "function": {"parameters": {"type": "object"}, "name": "f", "strict": None},
    }
    tools = _prompt_text(server, {"messages": messages[:1], "tools": [as_sent]})
    assert (
        '\n{"parameters": {"type": "object"}, "name": "f", "strict": null}\n' in tools
    )  # as DeepSeek prints


@pytest.mark.parametrize("thinking", [False, True])
def test_forced_dsml_comes_back_as_tool_calls(server: Server, thinking: bool) -> None:
    forced = ("Bath needs the weather tool.</think>" if thinking else "") + DSML_CALL
    body = {
        "messages": [{"role": "user", "content": "Weather in Bath?"}],
        "tools": [WEATHER],
        "guided_regex": literal(forced),
        "max_tokens": 400,
        "chat_template_kwargs": {"thinking": thinking},
    }
    r = _post(server, "/v1/chat/completions", body).json()
    choice = r["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and message["content"] is None
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]
    ] == [("get_weather", {"city": "Bath", "days": 3})]
    reasoning = "Bath needs the weather tool." if thinking else None
    assert message["reasoning_content"] == message["reasoning"] == reasoning

    chunks = _stream(server, body)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls = [d["tool_calls"][0] for d in deltas if d.get("tool_calls")]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    arguments = [c["function"]["arguments"] for c in calls if c["function"]["arguments"]]
    assert len(arguments) > 1 and "".join(arguments) == message["tool_calls"][0]["function"]["arguments"]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == (reasoning or "")
    assert not any("DSML" in (d.get("content") or "") for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_thinking_output_splits_into_reasoning_then_content(server: Server) -> None:
    body = {
        "messages": [{"role": "user", "content": "Weather in Bath?"}],
        "guided_regex": literal("It rains in Bath.</think>Take an umbrella."),
        "max_tokens": 100,
        "chat_template_kwargs": {"thinking": True},
    }
    message = _post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]
    assert message["reasoning_content"] == message["reasoning"] == "It rains in Bath."
    assert message["content"] == "Take an umbrella."
    deltas = [c["choices"][0]["delta"] for c in _stream(server, body) if c["choices"]]
    kinds = [k for d in deltas for k in ("reasoning_content", "content") if d.get(k)]
    assert kinds == sorted(kinds, key=lambda k: k == "content") and "content" in kinds
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "It rains in Bath."
    assert "".join(d.get("content") or "" for d in deltas) == "Take an umbrella."
    assert all(d.get(k) is None or d[k] == d.get("reasoning") for d in deltas for k in ("reasoning_content",))


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_required_and_named_tool_choice_are_forced_in_dsml(server: Server, choice: Any) -> None:
    body = {
        "messages": [{"role": "user", "content": "Weather in Bath?"}],
        "tools": [WEATHER],
        "tool_choice": choice,
        "parallel_tool_calls": False,
        "chat_template_kwargs": {"thinking": False},
        "max_tokens": 120,
        "temperature": 0,
    }
    choice_out = _post(server, "/v1/chat/completions", body).json()["choices"][0]
    message = choice_out["message"]
    assert "DSML" not in (message["content"] or "")  # cut off or not, markup never shows
    if choice_out["finish_reason"] == "tool_calls":
        (call,) = message["tool_calls"]
        args = json.loads(call["function"]["arguments"])
        assert call["function"]["name"] == "get_weather" and set(args) == {"city", "days"}
    else:
        assert choice_out["finish_reason"] == "length" and not message["tool_calls"]


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"reasoning_effort": "low"}, "reasoning_effort"),
        ({"chat_template_kwargs": {"reasoning_effort": "medium"}}, "chat_template_kwargs.reasoning_effort"),
        ({"chat_template_kwargs": {"thinking": "yes"}}, "chat_template_kwargs.thinking"),
        ({"continue_final_message": True}, "add_generation_prompt"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "r"}]}, "messages.1"),
        ({"messages": [{"role": "developer", "content": ""}]}, "messages.0"),
        ({"messages": [{"role": "critic", "content": "a"}]}, "messages.0.role"),
    ],
)
def test_bad_chat_fields_are_400s_naming_the_field(
    server: Server, change: dict[str, Any], param: str
) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **change}
    for path in ("/v1/chat/completions", "/tokenize"):
        r = _post(server, path, body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error"


def test_auto_tool_choice_reads_text_or_a_call_held_to_the_schema(server: Server) -> None:
    body = {
        "messages": [{"role": "user", "content": "Weather in Bath?"}],
        "tools": [WEATHER],
        "tool_choice": "auto",
        "chat_template_kwargs": {"thinking": False},
        "max_tokens": 60,
        "temperature": 0,
    }
    message = _post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]
    assert "DSML" not in (message["content"] or "")
    for call in message["tool_calls"]:
        assert call["function"]["name"] == "get_weather"
        assert set(json.loads(call["function"]["arguments"])) == {"city", "days"}


def test_an_openai_client_tool_loop_round_trips_its_own_history(server: Server) -> None:
    """The official client's messages, replayed: the call and its reasoning go back into the prompt as
    DSML, the result as a <tool_result> block of the next user turn."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    messages: list[Any] = [{"role": "user", "content": "Weather in Bath?"}]
    thinking = {"chat_template_kwargs": {"thinking": True}}
    forced = "Use the tool.</think>" + DSML_CALL
    first = client.chat.completions.create(
        model="austen",
        messages=messages,
        tools=[WEATHER],  # type: ignore[list-item]
        max_tokens=400,
        extra_body={**thinking, "guided_regex": literal(forced)},
    ).choices[0]
    assert first.finish_reason == "tool_calls" and first.message.tool_calls
    messages.append(first.message.model_dump(exclude_none=True))
    messages += [{"role": "tool", "tool_call_id": c.id, "content": "Sunny"} for c in first.message.tool_calls]
    reply = client.chat.completions.create(
        model="austen",
        messages=messages,
        tools=[WEATHER],
        max_tokens=4,
        extra_body=thinking,  # type: ignore[list-item]
    )
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    prompt = _prompt_text(server, {"messages": messages, "tools": [WEATHER], **thinking})
    assert prompt.endswith(
        f"<｜Assistant｜><think>Use the tool.</think>{DSML_CALL}<｜end▁of▁sentence｜>"
        "<｜User｜><tool_result>Sunny</tool_result><｜Assistant｜><think>"
    )


def test_a_langchain_tool_loop_runs_end_to_end(server: Server) -> None:
    """LangChain's ChatOpenAI, as agent frameworks drive it: tools bound, a required call (held to DSML by
    the grammar), the tool's result sent back as a ToolMessage, and an answer."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        model="austen",
        base_url=f"{server.url}/v1",
        api_key=API_KEY,  # type: ignore[arg-type]
        max_tokens=400,
        max_retries=0,
        timeout=120,
        temperature=0,
    )
    messages: list[Any] = [HumanMessage("Weather in Bath?")]
    first = chat.bind_tools([WEATHER], tool_choice="required").invoke(messages)
    assert first.tool_calls and first.tool_calls[0]["name"] == "get_weather"
    assert set(first.tool_calls[0]["args"]) == {"city", "days"}
    assert "DSML" not in str(first.content)
    messages += [first, ToolMessage("Sunny", tool_call_id=first.tool_calls[0]["id"])]
    reply = chat.bind_tools([WEATHER]).invoke(messages, max_tokens=4)
    assert reply.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")
    prompt = _prompt_text(server, {"messages": _openai_messages(messages), "tools": [WEATHER]})
    assert "<tool_result>Sunny</tool_result>" in prompt and '<｜DSML｜invoke name="get_weather">' in prompt


def _openai_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """LangChain's messages as the OpenAI messages ChatOpenAI sent."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.type == "human":
            out.append({"role": "user", "content": m.content})
        elif m.type == "tool":
            out.append({"role": "tool", "tool_call_id": m.tool_call_id, "content": m.content})
        else:
            calls = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": json.dumps(c["args"])},
                }
                for c in m.tool_calls
            ]
            out.append({"role": "assistant", "content": m.content, "tool_calls": calls})
    return out


def _bundled_tool(name: str) -> dict[str, Any]:
    return next(t.definition() for t in TOOLS if t.name == name)


@pytest.mark.parametrize(
    ("request_text", "tools"),
    [("What is the weather in Bath?", ["get_weather"]), ("Add 12 and 30.", ["find_book", "add_numbers"])],
)
def test_the_bundled_model_calls_a_given_tool_by_itself(
    server: Server, request_text: str, tools: list[str]
) -> None:
    """No tool_choice and no grammar of the client's: the fine-tuned model starts a DSML call itself (with
    ``auto`` the server then holds it to the tool's schema), in tens of tokens."""
    body = {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": request_text}],
        "tools": [_bundled_tool(n) for n in tools],
        "chat_template_kwargs": {"thinking": False},
        "max_tokens": 120,
        "temperature": 0,
    }
    r = _post(server, "/v1/chat/completions", body).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    call = choice["message"]["tool_calls"][0]["function"]
    tool = next(t for t in TOOLS if t.name == call["name"])
    assert tool.name in tools
    arguments = json.loads(call["arguments"])
    assert set(tool.required) <= set(arguments) <= set(tool.properties)
    assert r["usage"]["completion_tokens"] <= MODEL_CALL_TOKENS, call


def test_the_bundled_model_closes_its_thinking(server: Server) -> None:
    body = {
        "messages": [{"role": "user", "content": "Tell me about Emma."}],
        "chat_template_kwargs": {"thinking": True},
        "max_tokens": 120,
        "temperature": 0,
    }
    choice = _post(server, "/v1/chat/completions", body).json()["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "stop"
    assert message["reasoning_content"] and message["content"]
    assert "think>" not in message["reasoning_content"] + message["content"]
