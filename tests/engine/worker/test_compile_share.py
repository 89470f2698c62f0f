"""A compile in the main thread pauses while a step runs in another, gets its share between steps, never
holds a step up for long on a lock it holds, and ends once abandoned."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

from hybridserve.engine.worker import compile_share
from hybridserve.engine.worker.compile_share import CompileShare


@dataclass
class PythonLoop:
    """A stand-in for dynamo tracing in the main thread: Python calls until abandoned."""

    share: CompileShare = field(default_factory=CompileShare)
    count: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    hold_lock: bool = False  # hold ``lock`` until ``release`` is set
    release: threading.Event = field(default_factory=threading.Event)

    def tick(self) -> None:
        self.count += 1

    def run_beside(self, steps: Callable[[PythonLoop], None]) -> None:
        """Loop here while ``steps`` runs in a thread; re-raise what it raised."""
        errors: list[BaseException] = []

        def run() -> None:
            try:
                steps(self)
            except BaseException as exc:
                errors.append(exc)
            finally:
                self.share.abandon()

        deadline = time.monotonic() + 60
        with self.share.compiling():
            thread = threading.Thread(target=run, daemon=True)
            thread.start()
            if self.hold_lock:
                with self.lock:
                    while not self.release.is_set():
                        self.tick()
            while time.monotonic() < deadline:
                self.tick()
            raise AssertionError("abandon never ended the loop")
        thread.join(10)
        if errors:
            raise errors[0]


def _ops(n: int = 300) -> torch.Tensor:
    x = torch.ones(8, 8)
    for _ in range(n):
        x = torch.tanh(x)
    return x


def _step_until_paused(share: CompileShare) -> None:
    """Inside a step: run ops until the compile has come to its pause."""
    for _ in range(10_000):
        if share.waited:
            return
        _ops(10)
    raise AssertionError("the compile never paused for the step")


def test_the_compile_waits_while_a_step_runs() -> None:
    def steps(loop: PythonLoop) -> None:
        with loop.share.step():
            _step_until_paused(loop.share)
            before = loop.count
            _ops()
            assert loop.count == before, "the compile ran during the step"

    loop = PythonLoop()
    loop.run_beside(steps)
    assert loop.share.paused_s > 0 and loop.share.abandoned


def test_the_next_step_leaves_the_compile_its_share() -> None:
    def steps(loop: PythonLoop) -> None:
        with loop.share.step():
            _step_until_paused(loop.share)
        after_first = loop.count
        with loop.share.step():
            between = loop.count - after_first  # counted once the pause it was owed is over
        assert loop.share.yielded_s > 0
        assert between > 0, "back-to-back steps starved the compile"

    PythonLoop().run_beside(steps)


def test_a_lock_the_compile_holds_delays_a_step_only_briefly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compile_share, "MAX_PAUSE_S", 0.05)

    def steps(loop: PythonLoop) -> None:
        with loop.share.step():
            _step_until_paused(loop.share)
            loop.release.set()  # the compile lets go of the lock once its pause times out
            assert loop.lock.acquire(timeout=10), "the step waited on the paused compile's lock"
            loop.lock.release()

    PythonLoop(hold_lock=True).run_beside(steps)


def test_a_compile_runs_in_the_main_thread_only() -> None:
    errors: list[BaseException] = []

    def enter() -> None:
        try:
            with CompileShare().compiling():
                pass
        except RuntimeError as exc:
            errors.append(exc)

    thread = threading.Thread(target=enter)
    thread.start()
    thread.join(10)
    assert errors and "main thread" in str(errors[0])


def test_without_a_compile_a_step_never_waits() -> None:
    share = CompileShare()
    for _ in range(3):
        with share.step():
            _ops(10)
    assert share.yielded_s == 0 and share.paused_s == 0
