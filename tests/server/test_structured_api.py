"""Structured outputs, tools and the rest of vLLM's API surface, through the official openai client, on
the bundled model (served under two names, with a --chat-template file)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema_rs
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridserve.tokenizer import DEEPSEEK_CHAT_TEMPLATE, TOOL_CALLS_BEGIN
from tests.server.conftest import API_KEY, Server, start_server, stop_server

BUNDLED = Path(__file__).resolve().parents[2] / "hybridserve" / "assets" / "austen-v4"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MARK = "[custom template]"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "days": {"type": "integer", "maximum": 9},
            },
            "required": ["city", "days"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "GMT"]}},
            "required": ["zone"],
        },
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Overrides the package's tiny-model server: the bundled model fits tool prompts and real text."""
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text("{{ '" + MARK + "' }}" + DEEPSEEK_CHAT_TEMPLATE)
    s = start_server(
        BUNDLED,
        "--api-key",
        API_KEY,
        "--served-model-name",
        "austen",
        "austen-alias",
        "--chat-template",
        str(template),
        "--max-num-seqs",
        "8",
        "--max-num-batched-tokens",
        "256",
        "--block-tokens",
        "16",
    )
    s.model = "austen"
    yield s
    assert stop_server(s) == 0


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def _chat(client: openai.OpenAI, content: str, **kwargs: Any) -> Any:
    kwargs.setdefault("max_tokens", 120)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(
        model="austen", messages=[{"role": "user", "content": content}], **kwargs
    )


def _post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=60)


# ---- the rest of the surface --------------------------------------------------------------------------
def test_unknown_fields_are_ignored(client: openai.OpenAI) -> None:
    extra = {
        "metadata": {"k": "v"},
        "store": False,
        "some_future_field": [1, 2],
        "parallel_tool_calls": False,
    }
    r = _chat(client, "Hello", max_tokens=3, extra_body=extra)
    assert r.choices[0].message.content is not None
    c = client.completions.create(model="austen", prompt="Hi", max_tokens=2, extra_body={"unknown": {"a": 1}})
    assert c.usage is not None and c.usage.completion_tokens == 2


def test_served_model_names_template_and_utility_endpoints(client: openai.OpenAI, server: Server) -> None:
    assert [m.id for m in client.models.list().data] == ["austen"]
    r = client.completions.create(model="austen-alias", prompt="Hi", max_tokens=2)
    assert r.model == "austen"
    messages = [{"role": "user", "content": "Hello"}]
    tok = _post(server, "/tokenize", {"model": "austen", "messages": messages}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] > 0
    text = _post(server, "/detokenize", {"tokens": tok["tokens"]}).json()["prompt"]
    assert text.startswith(MARK) and "Hello" in text
    plain = _post(server, "/tokenize", {"prompt": "It is a truth", "return_token_strs": True}).json()
    assert "".join(plain["token_strs"][1:]) == "It is a truth"
    assert _post(server, "/detokenize", {"tokens": [10**9]}).status_code == 400
    assert _post(server, "/tokenize", {"prompt": "x", "messages": messages}).status_code == 400
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_tool_messages_logit_bias_and_prompt_logprobs(client: openai.OpenAI, server: Server) -> None:
    (the,) = _post(server, "/tokenize", {"prompt": " the", "add_special_tokens": False}).json()["tokens"]
    r = client.chat.completions.create(
        model="austen",
        messages=[
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [_call("get_weather", '{"city": "Bath", "days": 1}')],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "Rain all week."},
        ],
        max_tokens=4,
        logit_bias={str(the): 100},
        temperature=0,
    )
    assert r.choices[0].message.content == " the the the the"
    echo = client.completions.create(
        model="austen", prompt="It is a truth", max_tokens=2, echo=True, logprobs=2
    )
    lp = echo.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.tokens is not None
    n_prompt = len(_post(server, "/tokenize", {"prompt": "It is a truth"}).json()["tokens"])
    assert len(lp.tokens) == n_prompt + 2 and lp.token_logprobs[0] is None
    assert all(isinstance(v, float) for v in lp.token_logprobs[1:])
    raw = _post(
        server,
        "/v1/completions",
        {"model": "austen", "prompt": "A truth", "max_tokens": 1, "prompt_logprobs": 1},
    )
    entries = raw.json()["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and all(len(e) >= 1 for e in entries[1:])


# ---- structured outputs ---------------------------------------------------------------------------------
leaf = st.one_of(
    st.just({"type": "integer", "minimum": 0, "maximum": 999}),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 8)),
    st.lists(st.sampled_from(["Emma", "Darcy", "Bath", "x y"]), min_size=1, max_size=3, unique=True).map(
        lambda v: {"enum": v}
    ),
)
schemas = st.recursive(
    leaf,
    lambda inner: st.one_of(
        st.builds(lambda i, n: {"type": "array", "items": i, "maxItems": n}, inner, st.integers(0, 3)),
        st.dictionaries(
            st.sampled_from(["name", "age", "wife", "fortune"]), inner, min_size=1, max_size=3
        ).map(lambda p: {"type": "object", "properties": p, "required": sorted(p)}),
    ),
    max_leaves=5,
)


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(schema=schemas, temperature=st.sampled_from([0.0, 0.9]))
def test_json_schema_outputs_are_valid(
    client: openai.OpenAI, schema: dict[str, Any], temperature: float
) -> None:
    r = _chat(
        client,
        "Describe a character as JSON.",
        temperature=temperature,
        seed=1,
        max_tokens=200,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "c", "schema": schema, "strict": True},
        },
    )
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop", text
    assert jsonschema_rs.validator_for(schema).is_valid(json.loads(text)), (schema, text)


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"guided_regex": r"[A-Z][a-z]{1,6} [0-9]{2}"}, lambda t: t[0].isupper() and t[-2:].isdigit()),
        ({"guided_choice": ["Pride", "Prejudice"]}, lambda t: t in ("Pride", "Prejudice")),
        (
            {"guided_grammar": 'root ::= "Mr. " ("Darcy" | "Bingley")'},
            lambda t: t in ("Mr. Darcy", "Mr. Bingley"),
        ),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
        (
            {"guided_json": {"type": "array", "items": {"enum": [1, 22, 333]}, "maxItems": 3}},
            lambda t: isinstance(json.loads(t), list),
        ),
    ],
)
def test_guided_fields_constrain_chat_and_completions(client: openai.OpenAI, extra: dict, check: Any) -> None:
    chat = _chat(client, "Who?", extra_body=extra, max_tokens=80, temperature=0.7, seed=2)
    assert chat.choices[0].finish_reason == "stop", chat.choices[0].message.content
    assert check(chat.choices[0].message.content)
    done = client.completions.create(model="austen", prompt="Mr.", max_tokens=80, extra_body=extra)
    assert done.choices[0].finish_reason == "stop" and check(done.choices[0].text), done.choices[0].text


def test_json_object_is_json_as_far_as_it_goes(client: openai.OpenAI) -> None:
    """Any JSON object: unbounded, so the model may run to max_tokens; what it wrote is a JSON prefix."""
    for seed in range(3):
        r = _chat(
            client,
            "JSON:",
            response_format={"type": "json_object"},
            temperature=1.0,
            seed=seed,
            max_tokens=60,
        )
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert text.startswith("{")
        if finish == "stop":
            assert isinstance(json.loads(text), dict)


BAD = [
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
            }
        },
        "nonsense",
    ),
    ({"guided_json": '{"type": "object", "properties": {"a": {"$ref": "#/missing"}}}'}, "missing"),
    ({"guided_json": "{not json"}, "JSON schema"),
    ({"guided_regex": "(unclosed"}, "parenthesis"),
    ({"guided_grammar": 'start ::= "a"'}, "root"),
    ({"guided_grammar": "root ::= undefined_rule"}, "undefined_rule"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "at most one"),
    ({"tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
    (
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
            "tool_choice": "required",
        },
        "bogus",
    ),
]


@pytest.mark.parametrize(("extra", "word"), BAD, ids=lambda e: str(e)[:50])
def test_bad_schemas_and_grammars_get_400_and_the_server_keeps_serving(
    server: Server, extra: dict, word: str
) -> None:
    body = {"model": "austen", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **extra}
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert word in err["message"], err
    ok = _post(server, "/v1/completions", {"model": "austen", "prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_constrained_and_free_requests_mixed_in_one_batch(client: openai.OpenAI, server: Server) -> None:
    prompts = [f"Miss Bennet number {i} said" for i in range(8)]
    alone = [
        client.completions.create(model="austen", prompt=p, max_tokens=16, temperature=0).choices[0].text
        for p in prompts[::2]
    ]

    async def one(c: openai.AsyncOpenAI, i: int) -> str:
        extra = {"guided_regex": r"[a-z]{2,8}( [a-z]{2,8}){1,3}\."} if i % 2 else {}
        r = await c.completions.create(
            model="austen", prompt=prompts[i], max_tokens=16, temperature=0, extra_body=extra
        )
        return r.choices[0].text

    async def together() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0) as c:
            return await asyncio.gather(*(one(c, i) for i in range(8)))

    texts = asyncio.run(together())
    assert texts[::2] == alone
    assert all(re.fullmatch(r"[a-z]{2,8}( [a-z]{2,8}){1,3}\.", t) for t in texts[1::2]), texts


# ---- tools ----------------------------------------------------------------------------------------------
def _call(name: str, arguments: str, call_id: str = "call_1") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _streamed_calls(chunks: list[Any]) -> tuple[list[dict[str, str]], str | None]:
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in chunks:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] += d.id or ""
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_tool_call_round_trip_streamed_and_not(client: openai.OpenAI, choice: Any) -> None:
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Bath?"}]
    # One call (a tiny model that may call forever would otherwise run to max_tokens); named: always one.
    kwargs = dict(
        model="austen",
        tools=[WEATHER, TIME],
        tool_choice=choice,
        parallel_tool_calls=False,
        max_tokens=150,
        temperature=0,
    )
    r = client.chat.completions.create(messages=messages, **kwargs)  # type: ignore[call-overload]
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.tool_calls
    tools = {"get_weather": WEATHER, "get_time": TIME}
    for call in msg.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        schema = tools[call.function.name]["function"]["parameters"]
        assert jsonschema_rs.validator_for(schema).is_valid(json.loads(call.function.arguments))
    if isinstance(choice, dict):
        assert {c.function.name for c in msg.tool_calls} == {"get_time"}

    streamed, finish = _streamed_calls(
        list(client.chat.completions.create(messages=messages, stream=True, **kwargs))
    )
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in msg.tool_calls
    ]

    messages += [
        {"role": "assistant", "content": msg.content, "tool_calls": [c.model_dump() for c in msg.tool_calls]},
        *({"role": "tool", "tool_call_id": c.id, "content": "Sunny, 22 C"} for c in msg.tool_calls),
    ]
    reply = client.chat.completions.create(
        model="austen", messages=messages, tools=[WEATHER, TIME], max_tokens=8
    )
    assert reply.choices[0].message.content is not None


def test_parallel_required_calls_parse_what_completed(client: openai.OpenAI) -> None:
    """Parallel calls: a tiny model may go on calling until max_tokens; the calls it completed are returned,
    and a call cut off never comes back as markup in the content."""
    r = _chat(client, "Weather and time?", tools=[WEATHER, TIME], tool_choice="required", max_tokens=150)
    msg, finish = r.choices[0].message, r.choices[0].finish_reason
    assert all(c.function.name in ("get_weather", "get_time") for c in msg.tool_calls or [])
    if finish == "tool_calls":
        assert msg.tool_calls
    else:
        assert finish == "length"
        assert TOOL_CALLS_BEGIN not in (msg.content or "")


def test_tool_choice_auto_and_none_return_text(client: openai.OpenAI) -> None:
    for choice in ("auto", "none"):
        r = _chat(client, "Tell me about Emma.", tools=[WEATHER], tool_choice=choice, max_tokens=12)
        assert r.choices[0].message.content and not r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "length"
