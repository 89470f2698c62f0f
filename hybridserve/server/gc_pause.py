"""The garbage collector kept off the event loop's back: a full collection holds the GIL for as long as it
walks the heap (0.1-0.3 s in a serving process), so every stream waits, whichever thread runs it."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_paused = 0


def freeze_startup_heap() -> None:
    """Collect once, then move every object alive after start-up (modules, the tokenizer, schemas) out of
    the collector's reach, so that later collections walk only what requests allocate (as vLLM does)."""
    gc.collect()
    gc.freeze()


def thaw_heap() -> None:
    """Undo ``freeze_startup_heap`` at shutdown, so that what it froze is finalised as the process ends
    (extension types report frozen objects as leaks), and an app built again in one process starts clean."""
    gc.unfreeze()


@contextmanager
def gc_paused() -> Iterator[None]:
    """No automatic collection while a large body is decoded and validated: it allocates ~1M objects and
    would trigger several full collections on the way; the young objects are collected once, after."""
    global _paused
    with _lock:
        _paused += 1
        gc.disable()
    try:
        yield
    finally:
        with _lock:
            _paused -= 1
            if _paused == 0:
                gc.enable()
