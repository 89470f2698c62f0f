"""The engine-core process runs its loop in a thread while its main thread compiles: the compile pauses
for each step, the steps' outputs are the eager engine's, and the loop's end (or failure) ends a compile
that is still under way."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from hybridserve.engine import llm as llm_module
from hybridserve.engine.core import process
from hybridserve.engine.llm import LLM
from hybridserve.engine.request import RequestOutput, SamplingParams

ENGINE = dict(block_tokens=8, max_num_seqs=4, max_model_len=256)
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 7, 9, 11] * 5, [3, 4, 8], [12, 6, 2, 9, 9, 1, 4]]


def _endless_compile(name: str, warm: Callable[[], str | None]) -> None:
    while True:  # a compile's Python, that never ends on its own
        sum(range(50))


class _Loop:
    """Stands in for the core loop: generates, then returns a status (or raises)."""

    def __init__(self, llm: LLM, fail: bool = False) -> None:
        self.llm, self.fail = llm, fail
        self.outputs: list[RequestOutput] = []

    def run(self) -> int:
        self.outputs = self.llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        if self.fail:
            raise RuntimeError("the loop failed")
        return 0


@pytest.fixture
def beside(
    monkeypatch: pytest.MonkeyPatch, tiny_checkpoint: Callable[[str], Path]
) -> tuple[LLM, list[list[int]]]:
    folder = str(tiny_checkpoint("mixed"))
    plain = LLM(folder, enforce_eager=True, **ENGINE).generate(PROMPTS, PARAMS, use_tqdm=False)
    monkeypatch.setattr(llm_module, "_warm_up", lambda engine, show: None)  # as in the core process
    llm = LLM(folder, **ENGINE)  # compiled by default
    assert llm.engine.compiles_in_background
    monkeypatch.setattr(llm.engine.runner, "_warm_part", _endless_compile)
    llm.engine.runner.graphs.start_gating()
    return llm, [o.outputs[0].token_ids for o in plain]


def test_the_loop_runs_beside_a_compile_that_pauses_for_steps(
    beside: tuple[LLM, list[list[int]]],
) -> None:
    llm, want = beside
    loop = _Loop(llm)
    assert process._run_beside_compile(llm.engine, loop) == 0  # type: ignore[arg-type]
    assert [o.outputs[0].token_ids for o in loop.outputs] == want
    share = llm.engine.runner.compile_share
    assert share.abandoned and share.paused_s > 0 and share.yielded_s > 0
    assert set(llm.engine.runner.steps_by_path) == {"eager"}


def test_a_loop_that_fails_ends_the_compile_and_raises(beside: tuple[LLM, list[list[int]]]) -> None:
    llm, _ = beside
    with pytest.raises(RuntimeError, match="the loop failed"):
        process._run_beside_compile(llm.engine, _Loop(llm, fail=True))  # type: ignore[arg-type]
    assert llm.engine.runner.compile_share.abandoned
