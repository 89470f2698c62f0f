"""The server driven by the official openai client: outputs, streaming, concurrency."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from hybridserve import LLM, SamplingParams
from tests.server.conftest import API_KEY, Server

PROMPTS = [f"It is a truth {i}" + " universally" * (i % 5) for i in range(16)]


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def offline(server: Server) -> LLM:
    return LLM(str(server.folder), block_tokens=8, enforce_eager=True)


def test_models_lists_the_served_model(client: openai.OpenAI, server: Server) -> None:
    assert [m.id for m in client.models.list().data] == [server.model]


def test_sixteen_concurrent_clients_equal_offline_generate(server: Server, offline: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].text for o in offline.generate(PROMPTS, params)]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        r = await client.completions.create(
            model=server.model, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
        return r.choices[0].text

    async def all_at_once() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0) as c:
            return await asyncio.gather(*(one(c, p) for p in PROMPTS))

    assert asyncio.run(all_at_once()) == expected


def test_streaming_sends_each_token_and_matches_non_streaming(client: openai.OpenAI, server: Server) -> None:
    kwargs = dict(
        model=server.model, prompt=PROMPTS[3], max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    whole = client.completions.create(**kwargs)  # type: ignore[call-overload]
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert len(text_chunks) >= 5  # tokens arrive as they are made, not in one piece at the end
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10
    assert whole.usage is not None and whole.usage.completion_tokens == 10


def test_raw_stream_ends_with_done(server: Server) -> None:
    body = {"model": server.model, "prompt": "Hi", "max_tokens": 3, "stream": True}
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}
    ) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


def test_chat_streaming_and_not(client: openai.OpenAI, server: Server) -> None:
    messages = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hello there"}]
    whole = client.chat.completions.create(
        model=server.model,
        messages=messages,
        max_tokens=8,  # type: ignore
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    stream = client.chat.completions.create(
        model=server.model,
        messages=messages,
        max_tokens=8,  # type: ignore
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert whole.choices[0].finish_reason == "length" and whole.usage is not None


def test_n_echo_logprobs_and_seed(client: openai.OpenAI, server: Server) -> None:
    kwargs = dict(
        model=server.model,
        prompt="A truth",
        max_tokens=6,
        n=3,
        temperature=1.0,
        seed=7,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    r = client.completions.create(**kwargs)  # type: ignore[call-overload]
    assert [c.index for c in r.choices] == [0, 1, 2] and len({c.text for c in r.choices}) > 1
    again = client.completions.create(**kwargs)  # type: ignore[call-overload]
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    lp = r.choices[0].logprobs
    assert (
        lp is not None
        and len(lp.token_logprobs or []) == 6
        # Keyed by token text: byte tokens that each decode to "\ufffd" share a key, so 1 to 3 entries.
        and all(1 <= len(t) <= 3 for t in lp.top_logprobs or [])
    )
    echoed = client.completions.create(model=server.model, prompt="A truth", max_tokens=2, echo=True)
    assert echoed.choices[0].text.startswith("A truth")


def test_chat_logprobs(client: openai.OpenAI, server: Server) -> None:
    r = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)


def test_stop_string_across_tokens_is_not_leaked(client: openai.OpenAI, server: Server) -> None:
    kwargs = dict(model=server.model, prompt=PROMPTS[5], max_tokens=30, temperature=0)
    free = client.completions.create(extra_body={"ignore_eos": True}, **kwargs).choices[0].text  # type: ignore
    stop = free[5:9]
    assert len(stop) == 4
    streamed = list(client.completions.create(stream=True, stop=[stop], **kwargs))  # type: ignore
    text = "".join(c.choices[0].text for c in streamed if c.choices)
    assert text == free[: free.index(stop)] and stop not in text
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_streamed_text_is_whole_characters(client: openai.OpenAI, server: Server) -> None:
    kwargs = dict(
        model=server.model,
        prompt="café 🙂 中文",
        max_tokens=40,
        temperature=1.0,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    whole = client.completions.create(**kwargs).choices[0].text  # type: ignore[call-overload]
    pieces = [c.choices[0].text for c in client.completions.create(stream=True, **kwargs)]  # type: ignore
    assert "".join(pieces) == whole


def test_prefix_hits_show_in_usage_and_metrics_and_reset_clears_them(
    client: openai.OpenAI, server: Server
) -> None:
    prompt = "It is a truth universally acknowledged, that a single man " * 3
    kwargs = dict(model=server.model, prompt=prompt, max_tokens=2, temperature=0)
    cold = client.completions.create(**kwargs)  # type: ignore[call-overload]
    hits_before = server.metrics()["hybridserve_prefix_cache_hits_total"]
    warm = client.completions.create(**kwargs)  # type: ignore[call-overload]
    assert cold.usage is not None and warm.usage is not None and warm.usage.prompt_tokens_details is not None
    cached = warm.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and cached >= warm.usage.prompt_tokens - 8 and cached % 8 == 0
    assert warm.choices[0].text == cold.choices[0].text
    m = server.metrics()
    assert m["hybridserve_prefix_cache_hits_total"] == hits_before + cached
    assert 0 < m["hybridserve_prefix_cache_hit_rate"] <= 1
    assert httpx.post(f"{server.url}/v1/cache/reset").status_code == 401
    assert httpx.post(
        f"{server.url}/v1/cache/reset", headers={"Authorization": f"Bearer {API_KEY}"}
    ).json() == {"reset": True}
    after = client.completions.create(**kwargs)  # type: ignore[call-overload]
    assert after.usage is not None and after.usage.prompt_tokens_details is not None
    assert after.usage.prompt_tokens_details.cached_tokens == 0


def test_metrics_show_the_cache_arena_and_each_groups_pages(client: openai.OpenAI, server: Server) -> None:
    m = server.metrics()
    total = m["hybridserve_kv_arena_pages_total"]
    assert m["hybridserve_kv_arena_page_bytes"] > 0 and total > 0
    assert m["hybridserve_kv_arena_pages_free"] + m["hybridserve_kv_arena_pages_parked"] <= total
    held = {k: v for k, v in m.items() if k.startswith("hybridserve_kv_arena_pages_held{")}
    assert 'hybridserve_kv_arena_pages_held{group="swa_kv"}' in held
    assert total - m["hybridserve_kv_arena_pages_free"] == sum(held.values())
    assert "hybridserve_kv_arena_pages_reclaimed_total" in m


@pytest.mark.parametrize("stream", [False, True])
def test_latency_metrics_count_every_token_whether_streamed_or_not(
    client: openai.OpenAI, server: Server, stream: bool
) -> None:
    """A whole answer gets only its final output from the engine (FINAL_ONLY), a stream only deltas;
    either way the server times the first token and every gap after it, and counts every token."""
    server.wait_idle()
    before = server.metrics()
    body = {"ignore_eos": True}
    kwargs = dict(model=server.model, prompt="It is a truth", max_tokens=6, temperature=0, extra_body=body)
    if stream:
        kwargs["stream_options"] = {"include_usage": True}
        chunks = list(client.completions.create(stream=True, **kwargs))  # type: ignore[call-overload]
        usage = chunks[-1].usage
    else:
        usage = client.completions.create(**kwargs).usage  # type: ignore[call-overload]
    assert usage is not None and usage.completion_tokens == 6
    server.wait_idle()
    after = server.metrics()

    def grew(name: str) -> float:
        return after[f"hybridserve_{name}_count"] - before.get(f"hybridserve_{name}_count", 0.0)

    assert grew("time_to_first_token_seconds") == 1
    assert grew("inter_token_latency_seconds") == 5
    assert grew("e2e_request_latency_seconds") == 1
