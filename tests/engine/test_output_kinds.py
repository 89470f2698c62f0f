"""RequestOutputKind: every kind tells the same story as the cumulative outputs, in its own shape."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hybridserve.config import default_model_path
from hybridserve.engine.output_processor import OutputProcessor
from hybridserve.engine.outputs import EngineCoreOutput
from hybridserve.engine.request import (
    FinishReason,
    Logprob,
    Request,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
)
from hybridserve.tokenizer import Tokenizer, load_tokenizer

TEXT = "It was a bright cold day in April, and the clocks were striking thirteen. Winston Smith went on."
STOP = "Winston"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tok = load_tokenizer(default_model_path())
    assert tok is not None
    return tok


def _run(tokenizer: Tokenizer, kind: RequestOutputKind, step_sizes: list[int]) -> list[RequestOutput]:
    """The same core outputs for every kind: TEXT's tokens in steps of ``step_sizes``, logprobs on, the
    stop string cutting the text; the last step finishes by length unless the stop string came first."""
    ids = tokenizer.encode(TEXT)
    params = SamplingParams(logprobs=1, max_tokens=len(ids), stop=[STOP], output_kind=kind)
    processor = OutputProcessor(tokenizer)
    processor.add_request(Request("r", [5, 6], params))
    outputs: list[RequestOutput] = []
    start = 0
    for n in step_sizes:
        new = ids[start : start + n]
        start += n
        entries = [{t: Logprob(-0.25 * t % 3, 1), t + 1: Logprob(-4.0, 2)} for t in new]
        finish = FinishReason.LENGTH if start >= len(ids) else None
        results, stopped = processor.process([EngineCoreOutput("r", new, entries, finish)])
        outputs += results
        if stopped:
            break
    return outputs


@pytest.mark.parametrize("step_sizes", [[1] * 40, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]])
def test_every_kind_tells_the_cumulative_story(tokenizer: Tokenizer, step_sizes: list[int]) -> None:
    cumulative = _run(tokenizer, RequestOutputKind.CUMULATIVE, step_sizes)
    final = cumulative[-1]
    want = final.outputs[0]
    assert final.finished and want.finish_reason == "stop" and want.stop_reason == STOP
    assert STOP not in want.text and want.text and want.logprobs is not None

    delta = _run(tokenizer, RequestOutputKind.DELTA, step_sizes)
    assert len(delta) == len(cumulative)
    assert "".join(o.outputs[0].text for o in delta) == want.text
    assert [t for o in delta for t in o.outputs[0].token_ids] == want.token_ids
    assert [e for o in delta for e in o.outputs[0].logprobs or []] == want.logprobs
    for d, c in zip(delta, cumulative, strict=True):
        assert d.outputs[0].token_ids == d.new_token_ids == c.new_token_ids
        assert d.outputs[0].text == d.new_text == c.new_text
        assert d.num_output_tokens == c.num_output_tokens == len(c.outputs[0].token_ids)
        assert d.outputs[0].cumulative_logprob == c.outputs[0].cumulative_logprob
    assert delta[-1].finished and delta[-1].outputs[0].finish_reason == "stop"

    only = _run(tokenizer, RequestOutputKind.FINAL_ONLY, step_sizes)
    assert len(only) == 1 and only[0].finished
    assert replace(only[0], new_token_ids=[], new_text="", new_logprobs=None) == replace(
        final, new_token_ids=[], new_text="", new_logprobs=None
    )


def test_aborted_requests_end_in_every_kind(tokenizer: Tokenizer) -> None:
    """An abort gives a final output in every kind (FINAL_ONLY included), with what was generated."""
    for kind in RequestOutputKind:
        processor = OutputProcessor(tokenizer)
        processor.add_request(Request("r", [5, 6], SamplingParams(max_tokens=9, output_kind=kind)))
        results, _ = processor.process([EngineCoreOutput("r", [40, 41], None, None)])
        assert len(results) == (0 if kind == RequestOutputKind.FINAL_ONLY else 1)
        out = processor.abort_request("r")
        assert out is not None and out.finished and out.outputs[0].finish_reason == "abort"
        assert out.num_output_tokens == 2
        assert out.outputs[0].token_ids == ([] if kind == RequestOutputKind.DELTA else [40, 41])


def test_output_kind_takes_ints_and_refuses_others() -> None:
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        SamplingParams(output_kind=7)  # type: ignore[arg-type]
