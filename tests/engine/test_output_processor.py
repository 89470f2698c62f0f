"""Outputs read after later steps: each keeps its own tokens' logprobs (a slow stream reader)."""

from __future__ import annotations

from hybridserve.engine.output_processor import OutputProcessor
from hybridserve.engine.outputs import EngineCoreOutput
from hybridserve.engine.request import FinishReason, Logprob, Request, SamplingParams


def _entry(chosen: int, other: int) -> dict[int, Logprob]:
    return {chosen: Logprob(-0.5, 1), other: Logprob(-1.5, 2)}


def test_each_output_keeps_its_own_logprobs_when_read_late() -> None:
    """Three steps processed before any output is read (a stream consumer a step behind the engine):
    every output's new logprobs are its own tokens' and its cumulative fields stop at its step."""
    processor = OutputProcessor(None)
    processor.add_request(Request("r", [5, 6, 7], SamplingParams(logprobs=1, max_tokens=4)))
    steps = [([11], [_entry(11, 12)]), ([13, 14], [_entry(13, 15), _entry(14, 16)]), ([17], [_entry(17, 18)])]
    outputs = []
    for n, (ids, entries) in enumerate(steps):
        finish = FinishReason.LENGTH if n == len(steps) - 1 else None
        results, _ = processor.process([EngineCoreOutput("r", ids, entries, finish)])
        outputs += results
    seen: list[int] = []
    for out, (ids, entries) in zip(outputs, steps, strict=True):
        seen += ids
        c = out.outputs[0]
        assert out.new_token_ids == ids and out.new_logprobs == entries
        assert all(tok in entry for tok, entry in zip(out.new_token_ids, out.new_logprobs, strict=True))
        assert c.token_ids == seen and c.logprobs is not None and len(c.logprobs) == len(seen)
    assert outputs[-1].finished and outputs[-1].outputs[0].logprobs == [e for _, es in steps for e in es]
