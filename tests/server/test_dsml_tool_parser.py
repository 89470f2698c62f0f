"""DeepSeek-V4's output read for reasoning and DSML tool calls, whole and streamed in arbitrary pieces
(no server)."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridserve.server.dsml_tool_calls import DsmlToolParser, parse_dsml
from hybridserve.server.errors import APIError
from hybridserve.server.output_parsers import OutputReading, reads_tools
from hybridserve.server.protocol import ChatCompletionRequest
from hybridserve.server.reasoning import ReasoningParser, split_reasoning
from hybridserve.server.serving import ServerSettings

CALLS = (
    "\n\n<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="location" string="true">Beijing "north"\n</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="opts" string="false">{"a": [1, true]}</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="now">\n\n</｜DSML｜invoke>\n'
    "</｜DSML｜tool_calls>"
)
TEXT = "Let me check." + CALLS
ARGS = {"location": 'Beijing "north"\n', "days": 3, "opts": {"a": [1, True]}}


def _pieces(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def test_whole_output_gives_calls_with_json_arguments_and_no_markup() -> None:
    content, calls = parse_dsml(TEXT)
    assert content == "Let me check."
    assert [c.function.name for c in calls] == ["get_weather", "now"]
    assert json.loads(calls[0].function.arguments) == ARGS and calls[1].function.arguments == "{}"
    assert calls[0].function.arguments == json.dumps(ARGS, ensure_ascii=False)  # DeepSeek's own spacing
    assert parse_dsml("no calls") == ("no calls", [])
    assert parse_dsml(CALLS)[0] is None


def test_a_value_that_is_not_json_stays_a_string() -> None:
    bad = CALLS.replace(">3<", ">three<")
    assert json.loads(parse_dsml(bad)[1][0].function.arguments)["days"] == "three"


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(0, len(TEXT)), max_size=16))
def test_streamed_name_first_then_arguments_that_join_to_the_whole_output(cuts: list[int]) -> None:
    parser, content, deltas = DsmlToolParser(), "", []
    pieces = _pieces(TEXT, cuts)
    for k, piece in enumerate(pieces):
        text, new = parser.feed(piece, final=k == len(pieces) - 1)
        content, deltas = content + text, deltas + new
    assert content == "Let me check."
    whole = parse_dsml(TEXT)[1]
    for i, call in enumerate(whole):
        mine = [d for d in deltas if d.index == i]
        assert mine[0].function.name == call.function.name and mine[0].id
        assert all(d.function.name is None for d in mine[1:])
        assert "".join(d.function.arguments or "" for d in mine) == call.function.arguments
    assert len([d for d in deltas if d.index == 0]) >= 4  # arguments arrive in several pieces


def test_a_call_cut_off_is_dropped_whole_and_its_markup_never_shows() -> None:
    for end in range(len("Let me check."), len(TEXT) - 1, 7):
        content, calls = parse_dsml(TEXT[:end])
        assert "DSML" not in (content or "") and "<｜" not in (content or "")
        assert [c.function.arguments for c in calls] == [json.dumps(ARGS), "{}"][: len(calls)]


def test_thinking_output_splits_at_the_boundary_which_never_shows() -> None:
    prompt = "<｜User｜>Hi<｜Assistant｜><think>"
    assert split_reasoning(prompt, "Hmm.</think>Hello") == ("Hmm.", "Hello")
    assert split_reasoning(prompt, "Hmm, still") == ("Hmm, still", None)  # cut off while reasoning
    assert split_reasoning("<｜Assistant｜></think>", "Hello") == (None, "Hello")  # chat mode
    reading = OutputReading(prompt, True, "deepseek_v4")
    reasoning, content, calls = reading.whole("I need the weather.</think>" + CALLS)
    assert (reasoning, content, [c.function.name for c in calls]) == (
        "I need the weather.",
        None,
        ["get_weather", "now"],
    )


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(0, 40), max_size=10))
def test_streamed_reasoning_then_content(cuts: list[int]) -> None:
    text = "<think>Let me think </thin k.</think>The answer."
    parser = ReasoningParser(in_reasoning=True)
    out: list[Any] = [parser.feed(p, final=False) for p in _pieces(text, [c for c in cuts if c < len(text)])]
    out.append(parser.feed("", final=True))
    assert "".join(r for r, _ in out) == "Let me think </thin k."
    assert "".join(c for _, c in out) == "The answer."
    last_reasoning = max(k for k, (r, _) in enumerate(out) if r)
    first_content = min(k for k, (_, c) in enumerate(out) if c)
    assert last_reasoning <= first_content


def test_auto_tool_choice_needs_the_flag_once_a_parser_is_named() -> None:
    tool = {"type": "function", "function": {"name": "f"}}
    body = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "a"}], tools=[tool], tool_choice="auto"
    )
    named = ServerSettings(model_name="m", tool_call_parser="deepseek_v4")
    with pytest.raises(APIError) as info:
        reads_tools(body, named)
    assert info.value.status == 400 and info.value.param == "tool_choice"
    assert reads_tools(body, replace(named, enable_auto_tool_choice=True))
    assert reads_tools(body, ServerSettings(model_name="m"))  # no parser named: calls are read anyway
    assert not reads_tools(body.model_copy(update={"tool_choice": None}), named)
    assert reads_tools(body.model_copy(update={"tool_choice": "required"}), named)


_FRAGMENTS = [
    "<｜DSML｜tool_calls>",
    "</｜DSML｜tool_calls>",
    '<｜DSML｜invoke name="f">',
    "</｜DSML｜invoke>",
    '<｜DSML｜parameter name="a" string="true">',
    '<｜DSML｜parameter name="b" string="false">',
    "</｜DSML｜parameter>",
    "\n",
    "\n\n",
    "<",
    "<｜DS",
    '"',
    "{",
    "1",
    "text",
    "}",
]


@settings(max_examples=300, deadline=None)
@given(
    parts=st.lists(st.sampled_from(_FRAGMENTS), max_size=24), cuts=st.lists(st.integers(0, 400), max_size=6)
)
def test_any_output_parses_to_json_calls_and_markup_free_content(parts: list[str], cuts: list[int]) -> None:
    text = "".join(parts)
    content, calls = parse_dsml(text)
    assert "<｜DSML｜tool_calls>" not in (content or "")
    for call in calls:
        json.loads(call.function.arguments)
    parser, streamed, deltas = DsmlToolParser(), "", []
    pieces = _pieces(text, [c for c in cuts if c <= len(text)])
    for k, piece in enumerate(pieces):
        out, new = parser.feed(piece, final=k == len(pieces) - 1)
        streamed, deltas = streamed + out, deltas + new
    assert streamed == (content or "")
    for i, call in enumerate(calls):
        joined = "".join(d.function.arguments or "" for d in deltas if d.index == i)
        assert joined == call.function.arguments
