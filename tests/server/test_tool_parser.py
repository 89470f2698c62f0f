"""DeepSeek tool-call parsing, whole and streamed in arbitrary pieces (no server)."""

from __future__ import annotations

import itertools
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridserve.server.tool_calls import StreamingToolParser, parse_tool_calls
from hybridserve.tokenizer import TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_CALLS_BEGIN, TOOL_CALLS_END, TOOL_SEP

TEXT = (
    f'Let me look.{TOOL_CALLS_BEGIN}{TOOL_CALL_BEGIN}get_weather{TOOL_SEP}{{"city": "Bath"}}{TOOL_CALL_END}'
    f'{TOOL_CALL_BEGIN}function{TOOL_SEP}get_time\n```json\n{{"zone": "UTC"}}\n```{TOOL_CALL_END}'
    f"{TOOL_CALLS_END}"
)


def test_whole_output_parses_both_deepseek_forms() -> None:
    content, calls = parse_tool_calls(TEXT)
    assert content == "Let me look."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Bath"}),
        ("get_time", {"zone": "UTC"}),
    ]
    assert len({c.id for c in calls}) == 2
    assert parse_tool_calls("no calls here") == ("no calls here", [])


def test_calls_cut_off_never_come_back_as_markup() -> None:
    """An output ended (by max_tokens) inside its calls: the completed ones are returned, the rest dropped."""
    cut = TEXT[: TEXT.index(f"{TOOL_CALL_BEGIN}function")] + f"{TOOL_CALL_BEGIN}get_ti"
    content, calls = parse_tool_calls(cut)
    assert content == "Let me look." and [c.function.name for c in calls] == ["get_weather"]
    assert parse_tool_calls(f"text {TOOL_CALLS_BEGIN}{TOOL_CALL_BEGIN}get") == ("text ", [])
    parser = StreamingToolParser()
    streamed = [parser.feed(cut[:20]), parser.feed(cut[20:], final=True)]
    assert "".join(text for text, _ in streamed) == "Let me look."


@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(0, len(TEXT)), max_size=12))
def test_streamed_pieces_give_the_same_content_and_calls(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(TEXT)]
    parser, content, calls = StreamingToolParser(), "", []
    for k, (a, b) in enumerate(itertools.pairwise(bounds)):
        text, deltas = parser.feed(TEXT[a:b], final=k == len(bounds) - 2)
        content += text
        calls += deltas
    assert content == "Let me look."
    whole = parse_tool_calls(TEXT)[1]
    assert [(d.index, d.function.name, d.function.arguments) for d in calls] == [
        (i, c.function.name, c.function.arguments) for i, c in enumerate(whole)
    ]


def test_plain_text_streams_through_and_a_stray_marker_prefix_is_flushed_at_the_end() -> None:
    parser = StreamingToolParser()
    assert parser.feed("Hello <｜tool") == ("Hello ", [])
    assert parser.feed("ish", final=True) == ("<｜toolish", [])
