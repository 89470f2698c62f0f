"""The router takes the decode worker's pull-time comment out of a stream, wherever the chunks split it."""

from __future__ import annotations

import json

import pytest

from hybridserve.engine.request import CompletionOutput, RequestOutput
from hybridserve.router.stream_params import ParamsFilter
from hybridserve.server.kv_transfer_params import decode_answer, decode_comment, handoff_seconds

CHUNK = b'data: {"choices":[{"index":0,"text":"a"}]}\n\n'
DONE = b"data: [DONE]\n\n"


def _final(seconds: float | None) -> RequestOutput:
    out = RequestOutput("r", None, [1], [CompletionOutput(0, "a", [2], None, "length")], True)
    out.kv_handoff_seconds = seconds
    return out


def _stream(*seconds: float | None) -> tuple[bytes, bytes]:
    """-> (what the decode worker sends, what a client must get)."""
    plain = CHUNK * 3 + DONE
    comment = decode_comment([_final(s) for s in seconds]).encode()
    return CHUNK * 3 + comment + DONE, plain


@pytest.mark.parametrize("size", [1, 2, 7, 30, 1000])
def test_the_comment_is_taken_out_and_read_whatever_the_chunk_size(size: int) -> None:
    sent, plain = _stream(0.25, None, 0.5)
    params = ParamsFilter()
    passed = b"".join(params.feed(sent[i : i + size]) for i in range(0, len(sent), size)) + params.flush()
    assert passed == plain
    assert [handoff_seconds(p) for p in params.found] == [[0.25, 0.5]]


def test_a_stream_without_a_pull_passes_unchanged() -> None:
    sent, plain = _stream(None)
    assert sent == plain
    params = ParamsFilter()
    assert params.feed(sent[:10]) + params.feed(sent[10:]) + params.flush() == plain
    assert params.found == []


def test_a_stream_cut_mid_event_passes_what_came() -> None:
    params = ParamsFilter()
    assert params.feed(CHUNK + b"data: {") == CHUNK
    assert params.flush() == b"data: {"


def test_the_json_answer_lists_only_choices_that_pulled() -> None:
    assert decode_answer([_final(None), _final(None)]) is None
    answer = decode_answer([_final(0.125), _final(None), _final(2.0)])
    assert answer == {"handoff_seconds": [0.125, 2.0]}
    assert handoff_seconds(json.loads(json.dumps(answer))) == [0.125, 2.0]
    assert handoff_seconds({"handoff_seconds": "x"}) == [] and handoff_seconds({}) == []
