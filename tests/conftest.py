from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hybridserve.layers.hyper_connection import set_compile
from tests.tiny_models import SPECS, add_random_mtp, make_checkpoint, make_tiny_dense_checkpoint

# Tiny models are dominated by per-op overhead; one thread is fastest and steadiest on shared CI machines.
torch.set_num_threads(1)
# Inductor's pool of compile worker processes (one per core) costs ~10 s of CPU to start in every
# process that compiles, more than the tiny models' kernels take to build: tests compile in-process.
# Read when inductor's config is first imported (not by `import torch`); started processes inherit it.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


@pytest.fixture(autouse=True)
def own_graph_cache(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Each test its own folder of saved step graphs (``engine/worker/saved_graphs.py``), inherited by the
    processes it starts: a test that patches the model's code must trace it, not load another test's."""
    folder = tmp_path_factory.mktemp("graphs")
    monkeypatch.setenv("HYBRIDSERVE_GRAPH_CACHE", str(folder))
    return folder


@pytest.fixture(autouse=True)
def eager_mhc_tail() -> None:
    """The mHC tail's process-wide compile switch off at each test's start, as in a new process: an engine's
    warm-up switches it on, and a later test's model run without an engine would compile its tail mid-run."""
    set_compile(False)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``tiny_checkpoint(name)``: folder of a tiny random transformers checkpoint (built once per session)."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = make_checkpoint(SPECS[name], tmp_path_factory.mktemp(f"ckpt_{name}"))
        return built[name]

    return get


@pytest.fixture(scope="session")
def mtp_checkpoint(
    tiny_checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Path]:
    """``mtp_checkpoint(name)``: the tiny checkpoint ``name`` with random MTP weights (built once)."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = tmp_path_factory.mktemp(f"mtp_{name}") / "model"
            add_random_mtp(tiny_checkpoint(name), built[name])
        return built[name]

    return get


@pytest.fixture(scope="session")
def tiny_dense_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int | None], Path]:
    """``tiny_dense_checkpoint(window)``: a tiny random checkpoint of the second architecture
    (``models/tiny_dense.py``), sliding-window attention over ``window`` tokens or full (None)."""
    built: dict[int | None, Path] = {}

    def get(window: int | None) -> Path:
        if window not in built:
            built[window] = make_tiny_dense_checkpoint(tmp_path_factory.mktemp(f"dense_{window}"), window)
        return built[window]

    return get


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slow_file(seconds): a file of about that much CPU time, scheduled before the others"
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test must have its own node id: pytest-xdist schedules by id and runs one test of each id.
    schemathesis names each API operation's test ``test_fuzz[GET /health]`` but gives them one id (pytest
    9 builds it from the original name), so each gets its operation as the id's parameters.

    Files marked ``slow_file`` run first, longest first (the Makefile runs xdist with
    ``--no-loadscope-reorder``, which keeps this order): left for the end, a minute-long file of one or
    two tests was the run's tail while the other worker sat idle."""
    items.sort(key=_slow_first)
    for item in items:
        if type(item).__name__ == "SchemathesisFunction" and "[" not in item.nodeid:
            _set_id_params(item, item.name.partition("[")[2].removesuffix("]"))
    repeated = [nodeid for nodeid, n in Counter(item.nodeid for item in items).items() if n > 1]
    if repeated:
        raise pytest.UsageError(f"tests share node ids (pytest-xdist would run one of each): {repeated}")


def _slow_first(item: pytest.Item) -> float:
    marker = item.get_closest_marker("slow_file")
    return -marker.kwargs["seconds"] if marker is not None else 0.0


def _set_id_params(item: pytest.Item, params: str) -> None:
    if hasattr(item, "_id"):  # pytest >= 9.1: structured node ids
        item._id = item._id.with_params(params)
    else:
        item._nodeid = f"{item.nodeid}[{params}]"
