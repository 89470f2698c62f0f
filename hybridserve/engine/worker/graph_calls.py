"""Calling a compiled graph without dynamo's per-call entry.

Every call of a ``torch.compile``'d function passes through dynamo: a cache lookup, the bytecode that
gathers the graph's inputs (every parameter, every buffer of the step) and a runtime prologue, ~0.3 ms on
CPU whatever the graph does (7% of a 16-request decode step of the bundled model). A static decode
step's inputs never change: the same persistent buffers and parameters, the same shape integers. So a
caller that saw one graph take the very same inputs twice, and return exactly what the function
returned, may call that graph with those inputs directly (:class:`DirectCall`).

:class:`RecordingBackend` is the ``torch.compile`` backend that makes this visible: inductor (or another
dynamo backend), with each compiled graph's calls (inputs and outputs) recorded while
:meth:`RecordingBackend.recording` is open.
It is only sound for a function with no Python side effects (dynamo would replay those after the graph):
the decode step reads its buffers and writes tensors, nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch


def tracing() -> AbstractContextManager[None]:
    """Dynamo's settings while it traces a step graph: fake tensors without their dispatch cache, and Python
    floats as constants. On these graphs (thousands of ops on tensors of symbolic sizes) the cache costs
    more than it saves: without it a prefill graph traced about 30% faster, a decode graph about 15% (tiny
    test models, eager backend). The floats a step reads are the model's constants (norm epsilons,
    scales); traced as symbols (dynamo's default under ``dynamic=True``), inductor cannot turn them all
    into tensors and dynamo traces the whole graph a second time with them specialised. Nested compile
    regions (``layers/hyper_connection.traced_tail``) are traced once and inlined back into one flat
    graph for the backend."""
    return torch._dynamo.config.patch(
        fake_tensor_cache_enabled=False, specialize_float=True, inline_invoke_subgraph=True
    )


def static_pool_tensors(cache: Mapping[Any, Any]) -> list[torch.Tensor]:
    """The tensors under a graph's cache rows (``BlockPoolSet.graph_tensors``): the pools never change
    shape, so no graph traces a symbol for them (``torch._dynamo.mark_static`` before the first compile:
    a decode graph made dynamic in its batch would otherwise make them dynamic too)."""
    return [rows if isinstance(rows, torch.Tensor) else rows.flat for rows in cache.values()]


def mark_static(tensors: list[torch.Tensor]) -> None:
    for tensor in tensors:
        torch._dynamo.mark_static(tensor)


class CompileOnFirstCall:
    """``torch.compile(fn, **options)``, made on the first call (after ``prepare``): importing the
    compiler takes seconds, which an engine that compiles in the background spends after it is ready."""

    def __init__(
        self, fn: Callable[..., Any], prepare: Callable[[], None] | None = None, **options: Any
    ) -> None:
        self._fn, self._prepare, self._options = fn, prepare, options
        self._compiled: Callable[..., Any] | None = None

    def __call__(self, *args: Any) -> Any:
        if self._compiled is None:
            if self._prepare is not None:
                self._prepare()
            self._compiled = torch.compile(self._fn, **self._options)
        return self._compiled(*args)


@dataclass
class GraphCall:
    """One call of a compiled graph: its flat inputs (tensors and shape ints) and outputs."""

    graph: Callable[..., Any]
    args: tuple[Any, ...]
    outputs: Any


class _RecordedGraph:
    def __init__(self, inner: Callable[..., Any], owner: RecordingBackend) -> None:
        self.inner, self.owner = inner, owner

    def __call__(self, *args: Any) -> Any:
        outputs = self.inner(*args)
        if self.owner.calls is not None:
            self.owner.calls.append(GraphCall(self.inner, args, outputs))
        return outputs


class RecordingBackend:
    """A ``torch.compile`` backend: ``backend`` (a dynamo backend's name; inductor with ``options``, its
    config patches), each graph's calls recorded inside :meth:`recording`."""

    def __init__(self, backend: str = "inductor", options: dict[str, Any] | None = None) -> None:
        self.backend, self.options = backend, dict(options or {})
        self.calls: list[GraphCall] | None = None

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        return self.wrap(self._compile(gm, example_inputs))

    def wrap(self, graph: Callable[..., Any]) -> Callable[..., Any]:
        """``graph`` with its calls recorded (a graph compiled elsewhere: ``saved_graphs``)."""
        return _RecordedGraph(graph, self)

    def _compile(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        if self.backend == "inductor":
            from torch._inductor.compile_fx import compile_fx

            compiled_fx: Callable[..., Any] = compile_fx(gm, example_inputs, config_patches=self.options)  # type: ignore[assignment]
            return compiled_fx
        compiled: Callable[..., Any] = torch._dynamo.lookup_backend(self.backend)(gm, example_inputs)
        return compiled

    @contextmanager
    def recording(self) -> Iterator[list[GraphCall]]:
        calls: list[GraphCall] = []
        self.calls = calls
        try:
            yield calls
        finally:
            self.calls = None


@dataclass
class DirectCall:
    """A graph and the inputs it always takes: calling it is the compiled function's call, minus dynamo."""

    graph: Callable[..., Any]
    args: tuple[Any, ...]

    def __call__(self) -> torch.Tensor:
        return self.graph(*self.args)[0]


def direct_call(before: list[GraphCall], now: list[GraphCall], result: Any) -> DirectCall | None:
    """The direct call of two dynamo calls' graph, if each ran exactly one graph, the same one, on the same
    inputs (the same tensor objects, equal ints), and the function returned that graph's one output."""
    if len(before) != 1 or len(now) != 1:
        return None
    (a,), (b,) = before, now
    same_inputs = len(a.args) == len(b.args) and all(map(_same_input, a.args, b.args))
    outputs = b.outputs
    returned = isinstance(outputs, (list, tuple)) and len(outputs) == 1 and outputs[0] is result
    if a.graph is not b.graph or not same_inputs or not returned:
        return None
    return DirectCall(b.graph, b.args)


def _same_input(x: Any, y: Any) -> bool:
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return x is y
    return type(x) is type(y) and x == y
