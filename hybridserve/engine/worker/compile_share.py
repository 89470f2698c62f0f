"""How a background compile and the steps that run eagerly beside it share the interpreter.

An eager step calls thousands of torch ops, and each releases the GIL. Beside a thread running Python
(dynamo tracing a graph), each op then waits for the GIL up to the switch interval (5 ms): 2,000 small ops
took 29 ms alone and 8.6-11.3 s beside a thread looping in Python (2-core AMD EPYC), and the bundled
model's eager decode ran several times slower while the engine compiled.

So the compile pauses while a step runs. It runs in the main thread, the steps in another: at the start of
each step the step thread signals the main thread (``SIGNAL``), whose handler waits until the step is
over; a handler only runs in the main thread, between its Python instructions, so the compile pays
nothing while no step runs (a profile hook in a compile thread, checked between calls, doubled the bundled
model's warm compile). Steps run back to back would starve it, so after each step it waited for, the step
loop leaves it ``share`` times that step's length before the next step (at the default 1.0, the compile
gets at least half of the time while steps keep coming). A pause lasts at most ``MAX_PAUSE_S``: the
compile may hold a lock (an import's) the step waits for. ``abandon`` stops the compile at its next signal
(the engine is shutting down).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

MAX_PAUSE_S = 0.25
SIGNAL = signal.SIGUSR1


class CompileAbandoned(BaseException):
    """Raised in the compile (main) thread by ``abandon``; a BaseException so that compilers' ``except
    Exception`` clauses let it through."""


class CompileShare:
    def __init__(self, share: float = 1.0) -> None:
        self.share = share
        self._idle = threading.Event()
        self._idle.set()
        self._main: int | None = None  # the compiling thread's id while it compiles
        self._stepping = False
        self._abandoned = False
        self.waited = False  # the compile came to a pause during the current step
        self._owed = 0.0  # seconds the next step leaves the compile first
        self._last_end = 0.0
        self.paused_s = 0.0  # the compile's time paused for steps
        self.yielded_s = 0.0  # the step loop's time left to the compile

    @contextmanager
    def compiling(self) -> Iterator[None]:
        """Run the body (a compile, in the main thread) pausing for steps; CompileAbandoned ends it
        quietly."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("a compile that pauses for steps runs in the main thread")
        signal.signal(SIGNAL, self._on_signal)  # kept afterwards: a late signal must not kill the process
        self._main = threading.get_ident()
        try:
            yield
        except CompileAbandoned:
            pass
        finally:
            self._main = None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._abandoned and self._main is not None:
            raise CompileAbandoned
        if self._stepping:
            self.waited = True
            start = time.perf_counter()
            try:
                self._idle.wait(MAX_PAUSE_S)
            finally:  # abandon's signal may end the pause
                self.paused_s += time.perf_counter() - start

    def abandon(self) -> None:
        """Stop the compile at its next Python instruction (from another thread)."""
        self._abandoned = True
        if (main := self._main) is not None:
            signal.pthread_kill(main, SIGNAL)

    @property
    def abandoned(self) -> bool:
        return self._abandoned

    @contextmanager
    def step(self) -> Iterator[None]:
        """Run a step (in the step thread) with the compile paused, after leaving it its share of the
        steps before (less the time the engine was idle since)."""
        main = self._main
        if main is None:
            yield
            return
        owed = self._owed - (time.perf_counter() - self._last_end)
        if owed > 0:
            time.sleep(owed)
            self.yielded_s += owed
        self._owed, self.waited = 0.0, False
        self._idle.clear()
        self._stepping = True
        signal.pthread_kill(main, SIGNAL)
        start = time.perf_counter()
        try:
            yield
        finally:
            self._stepping = False
            self._idle.set()
            self._last_end = time.perf_counter()
            if self.waited:
                self._owed = self.share * (self._last_end - start)
