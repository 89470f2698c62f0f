"""Step graphs traced ahead of time and kept on disk (``engine/worker/saved_graphs.py``): a second process
(here: a second ``SavedGraphs`` on the same folder) loads instead of tracing, gets the same numbers, and
traces again only where no saved graph's guards hold."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from hybridserve.engine.worker.graph_calls import RecordingBackend
from hybridserve.engine.worker.saved_graphs import SavedGraphs, store_key, store_root, unmarked


def _step(model: nn.Module, x: torch.Tensor, extra: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.relu(model(x)) * extra["scale"]


Args = tuple[nn.Module, torch.Tensor, dict[str, torch.Tensor]]


def _args(model: nn.Module, rows: int, width: int = 8) -> Args:
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(rows))
    torch._dynamo.maybe_mark_dynamic(x, 0)
    return model, x, {"scale": torch.full((1,), 2.0)}


def _graphs(folder: Path, recorder: RecordingBackend | None = None) -> SavedGraphs:
    return SavedGraphs(_step, "step", folder, recorder or RecordingBackend("inductor"))


@pytest.fixture
def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(8, 4)


def test_a_second_process_loads_the_graph_and_computes_the_same(model: nn.Module, tmp_path: Path) -> None:
    """Traced once for a dynamic row count, saved; a new instance on the folder loads it and serves other
    row counts without tracing, with the traced graph's numbers; its calls reach the recorder."""
    first = _graphs(tmp_path)
    with torch.no_grad():
        traced = first(*_args(model, 4))
    assert (first.traced, first.loaded) == (1, 0)
    assert len(list(tmp_path.glob("step-*.graph"))) == 1
    recorder = RecordingBackend("inductor")
    second = _graphs(tmp_path, recorder)
    with torch.no_grad(), recorder.recording() as calls:
        loaded = second(*_args(model, 4))
        other = second(*_args(model, 7))
    assert (second.traced, second.loaded) == (0, 1)
    assert len(calls) == 2
    assert torch.equal(traced, loaded)
    _, x, extra = _args(model, 7)
    torch.testing.assert_close(other, torch.relu(model(x)) * extra["scale"])


def test_inputs_its_guards_refuse_trace_a_new_graph_or_run_nothing(model: nn.Module, tmp_path: Path) -> None:
    """Another feature width fails the saved graph's guards: traced and saved beside it; with
    ``compile_missing`` off such a call returns None (the caller runs eagerly)."""
    with torch.no_grad():
        _graphs(tmp_path)(*_args(model, 4))
        wide = nn.Linear(16, 4)
        graphs = _graphs(tmp_path)
        graphs.compile_missing = False
        assert graphs(*_args(wide, 4, width=16)) is None
        graphs.compile_missing = True
        graphs(*_args(wide, 4, width=16))
    assert (graphs.loaded, graphs.traced) == (1, 1)
    assert len(list(tmp_path.glob("step-*.graph"))) == 2


def test_an_unreadable_file_is_traced_again(
    model: nn.Module, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "step-broken.graph").write_bytes(b"not a graph")
    graphs = _graphs(tmp_path)
    with torch.no_grad(), caplog.at_level(logging.WARNING):
        graphs(*_args(model, 4))
    assert (graphs.loaded, graphs.traced) == (0, 1)
    assert "could not load the saved graph" in caplog.text


def test_dim_marks_are_hidden_from_guards_and_restored() -> None:
    """Saved guards are rebuilt from tensors without dynamo's dim marks, so a check sees none; the marks
    are back afterwards for any trace that needs them."""
    x = torch.zeros(3, 2)
    torch._dynamo.maybe_mark_dynamic(x, 0)
    table = torch.zeros(2, 2)
    torch._dynamo.mark_static(table)
    args = (None, {"x": [x]}, (table,))
    with unmarked(args):
        assert not hasattr(x, "_dynamo_weak_dynamic_indices") and not hasattr(table, "_dynamo_static_indices")
    assert x._dynamo_weak_dynamic_indices == {0} and table._dynamo_static_indices == {0, 1}


def test_the_folder_is_keyed_by_what_the_graphs_were_traced_from(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert store_key(nn.Linear(8, 4), cpu) == store_key(nn.Linear(8, 4), cpu)
    assert store_key(nn.Linear(8, 4), cpu) != store_key(nn.Linear(8, 5), cpu)
    monkeypatch.setenv("HYBRIDSERVE_GRAPH_CACHE", "off")
    assert store_root() is None
    monkeypatch.delenv("HYBRIDSERVE_GRAPH_CACHE")
    assert store_root() is not None and store_root().name == "hybridserve-graphs"  # type: ignore[union-attr]


class _WithDtype(nn.Linear):
    """A model that keeps its dtype as an attribute (as DeepSeek-V4's modules do), unread by the step."""

    def __init__(self) -> None:
        super().__init__(8, 4)
        self.dtype = torch.float32


def test_a_dtype_attribute_the_guards_do_not_read_still_loads(tmp_path: Path) -> None:
    """The guards' pickler drops values the guards never read by identity: a model's ``self.dtype`` made
    every float32 in the saved guards unloadable (torch 2.13) until dtypes were pickled by name."""
    torch.manual_seed(0)
    model = _WithDtype()
    with torch.no_grad():
        traced = _graphs(tmp_path)(*_args(model, 4))
        second = _graphs(tmp_path)
        loaded = second(*_args(model, 4))
    assert (second.loaded, second.traced) == (1, 0)
    assert torch.equal(traced, loaded)
