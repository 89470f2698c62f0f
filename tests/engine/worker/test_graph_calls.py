"""Direct graph calls: only for one graph that took the very same inputs twice and returned the result."""

from __future__ import annotations

import torch

from hybridserve.engine.worker.graph_calls import GraphCall, RecordingBackend, direct_call


def _graph(*args: object) -> list[torch.Tensor]:
    return [torch.zeros(1)]


def _other(*args: object) -> list[torch.Tensor]:
    return [torch.ones(1)]


def test_direct_call_needs_the_same_graph_inputs_and_result() -> None:
    x, y, out = torch.zeros(2), torch.zeros(2), torch.zeros(1)
    first = [GraphCall(_graph, (x, 4), [torch.zeros(1)])]
    call = direct_call(first, [GraphCall(_graph, (x, 4), [out])], out)
    assert call is not None and call.graph is _graph and call.args == (x, 4)
    assert direct_call(first, [GraphCall(_graph, (y, 4), [out])], out) is None  # an equal, new tensor
    assert direct_call(first, [GraphCall(_graph, (x, 5), [out])], out) is None  # another shape int
    assert direct_call(first, [GraphCall(_graph, (x, 4.0), [out])], out) is None  # another type
    assert direct_call(first, [GraphCall(_other, (x, 4), [out])], out) is None  # another graph
    assert direct_call(first, [GraphCall(_graph, (x, 4), [out])], out.clone()) is None  # not returned
    assert direct_call(first, [GraphCall(_graph, (x, 4), [out, out])], out) is None  # two outputs
    two = [GraphCall(_graph, (x, 4), [out])] * 2  # a graph break: two graphs a call
    assert direct_call(two, two, out) is None
    assert direct_call([], first, out) is None


def test_recording_backend_calls_equal_the_compiled_function() -> None:
    """Dynamo's eager backend behind the recorder: the recorded graph, called directly with the recorded
    inputs, computes what the compiled function does, and follows the inputs' new contents."""
    torch._dynamo.reset()
    backend = RecordingBackend("eager")
    weight, x = torch.randn(3, 3), torch.randn(2, 3)

    def step(x: torch.Tensor) -> torch.Tensor:
        return (x @ weight).relu().sum(-1)

    compiled = torch.compile(step, backend=backend, dynamic=False)
    records = []
    for _ in range(2):
        with backend.recording() as calls:
            out = compiled(x)
        records.append(calls)
    call = direct_call(records[0], records[1], out)
    assert call is not None and backend.calls is None
    x.copy_(torch.randn(2, 3))
    assert torch.equal(call(), step(x))
