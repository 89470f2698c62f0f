"""Step graphs kept on disk with their guards, so that a restart does not trace them again.

Inductor's cache keeps generated code, not dynamo's trace: a warm restart of the bundled model still spent
~25 s tracing its decode and prefill graphs. ``torch._dynamo.aot_compile`` traces a function once for
example inputs and returns the graph with its guards in a form that can be saved; a later process loads it
in a fraction of a second and calls it where its guards hold. :class:`SavedGraphs` is that for one step
function: a call runs the first saved graph whose guards hold, else traces one for these inputs and saves
it. The function takes everything it reads as arguments (the model, the step's buffers, the cache
tensors): a graph holds no reference to a process's objects, and the model is handed back on loading.

Graphs live in a folder per :func:`store_key` (what they were traced from: the package's source, torch,
the machine's CPU or GPU, the model's structure and config) under ``$HYBRIDSERVE_GRAPH_CACHE``, else
under inductor's cache folder (clearing ``TORCHINDUCTOR_CACHE_DIR`` clears them too);
``HYBRIDSERVE_GRAPH_CACHE=off`` saves and loads nothing. A file that cannot be loaded is skipped, a graph
that cannot be saved is kept in memory, and a function that cannot be traced this way makes the caller
fall back to ``torch.compile``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import platform
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache, partial
from pathlib import Path
from typing import Any

import torch

from hybridserve.engine.worker.graph_calls import RecordingBackend, mark_static

log = logging.getLogger(__name__)

ENV = "HYBRIDSERVE_GRAPH_CACHE"
PACKAGE = Path(__file__).resolve().parents[2]  # the hybridserve package folder


def store_root() -> Path | None:
    """Where graph folders live (None: ``$HYBRIDSERVE_GRAPH_CACHE`` is "off")."""
    value = os.environ.get(ENV, "")
    if value.lower() == "off":
        return None
    if value:
        return Path(value)
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "hybridserve-graphs"


@cache
def _source_digest() -> str:
    """Every source file of the package: a graph traced from other code is another graph."""
    digest = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*.py")):
        digest.update(str(path.relative_to(PACKAGE)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _device_facts(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda {torch.cuda.get_device_name(device)} {torch.cuda.get_device_capability(device)}"
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return f"{device.type} {platform.machine()} {torch.backends.cpu.get_cpu_capability()} {pick_vec_isa()}"


def store_key(model: object, device: torch.device) -> str:
    """A digest of what a step graph was traced from: the package's source, torch's version, the device
    (the CPU's vector ISA: kernels built for one may not run on another), the model's modules and config."""
    parts = [
        _source_digest(),
        torch.__version__,
        _device_facts(device),
        repr(model),
        repr(getattr(model, "cfg", None)),
        str(getattr(model, "dtype", None)),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


MARKS = (  # what dynamo's mark_dynamic / maybe_mark_dynamic / mark_static leave on a tensor
    "_dynamo_dynamic_indices",
    "_dynamo_weak_dynamic_indices",
    "_dynamo_unbacked_indices",
    "_dynamo_strict_unbacked_indices",
    "_dynamo_static_indices",
    "_has_dynamo_dim_marking",
)


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors of a step's arguments: in dicts, sequences and dataclasses (not in modules)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name))


@contextmanager
def unmarked(args: tuple[Any, ...]) -> Iterator[None]:
    """The arguments' tensors without dynamo's dim marks while inside. A saved graph's guards are rebuilt
    from tensors that carry none (torch 2.13 does not save them), so they reject a marked tensor: the
    marks only tell a trace which dims to keep dynamic, and the size guards still check every dim."""
    kept = []
    for t in _tensors(args[1:]):
        marks = {name: t.__dict__.pop(name) for name in MARKS if name in t.__dict__}
        if marks:
            kept.append((t, marks))
    try:
        yield
    finally:
        for t, marks in kept:
            t.__dict__.update(marks)


@contextmanager
def _singletons_by_name() -> Iterator[None]:
    """Dtypes, layouts and memory formats pickled by name in a graph's guards. The guards' pickler drops
    each value the guards do not read (a module attribute, an argument) by its ``id``, and a dtype is one
    object process-wide: a model's ``self.dtype`` the guards never read made every float32 in the saved
    guards a placeholder that no load can rebuild a tensor from."""
    from torch._dynamo.guards import GuardsStatePickler

    reduce = GuardsStatePickler.reducer_override

    def by_name(pickler: GuardsStatePickler, obj: Any) -> Any:
        if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
            return NotImplemented
        return reduce(pickler, obj)

    GuardsStatePickler.reducer_override = by_name  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        GuardsStatePickler.reducer_override = reduce  # type: ignore[method-assign]


@contextmanager
def _graph_name(graph_name: str) -> Iterator[None]:
    """Dynamo names each graph ``__compiled_fn_<count>_<uuid>``, and an ahead-of-time trace's AOTAutograd
    cache key holds that name: no trace would ever find inductor's code of an earlier one (each cost a full
    compile, ~100 s for a decode graph of the bundled model). Named for what it is instead, the same trace
    finds its code again; a saved graph calls its compiled function from globals of its own, so two graphs
    of one name never meet."""
    import torch._dynamo.output_graph as output_graph

    unique_id = output_graph.unique_id

    def named(name: str, with_uuid: bool = False) -> str:
        return graph_name if name == "__compiled_fn" else unique_id(name, with_uuid)

    output_graph.unique_id = named
    try:
        yield
    finally:
        output_graph.unique_id = unique_id


def store_folder(model: object, device: torch.device) -> Path | None:
    """The folder of a model's graphs on this machine (None: none are kept)."""
    root = store_root()
    return None if root is None else root / store_key(model, device)


class SavedGraphs:
    """``torch.compile`` for ``fn``, its graphs traced ahead of time and kept in ``folder`` as
    ``<name>-<n>.graph``. The model (``fn``'s first argument) is handed to loaded graphs, never saved.
    Each graph's calls reach ``recorder`` (``RecordingBackend.recording``), as a ``torch.compile`` with
    that backend would. ``compile_missing`` False: a call no graph's guards accept returns None (the
    caller runs eagerly) rather than tracing one."""

    def __init__(
        self,
        fn: Callable[..., Any],
        name: str,
        folder: Path | Callable[[], Path | None] | None,
        recorder: RecordingBackend,
        prepare: Callable[[], None] | None = None,
        dynamic: bool | None = None,
    ) -> None:
        self.fn, self.name, self.recorder = fn, name, recorder
        self._folder = folder
        self.folder: Path | None = None  # resolved on the first call (finding it imports inductor)
        self._prepare, self._dynamic = prepare, dynamic
        self.graphs: list[Any] | None = None  # loaded on the first call
        self.compile_missing = True
        self.loaded = 0  # graphs read from the folder
        self.traced = 0  # graphs traced in this process

    @classmethod
    def of_step(
        cls,
        fn: Callable[..., Any],
        name: str,
        model: object,
        device: torch.device,
        recorder: RecordingBackend,
        static: list[torch.Tensor],
        dynamic: bool | None = None,
    ) -> SavedGraphs:
        """A model's step ``fn`` in the model's folder (``store_folder``, found at the first call: finding it
        imports inductor), the cache tensors ``static`` marked static before the first trace."""
        folder = partial(store_folder, model, device)
        return cls(fn, name, folder, recorder, partial(mark_static, static), dynamic)

    def __call__(self, *args: Any) -> Any:
        graph = self.graph_for(args)
        if graph is None:
            return None
        return graph.fn(*args)

    def graph_for(self, args: tuple[Any, ...]) -> Any:
        """The first graph whose guards hold for ``args``; traced (and saved) if none does."""
        if self.graphs is None:
            folder = self._folder
            self.folder = folder() if callable(folder) else folder
            if self._prepare is not None:
                self._prepare()
            self.graphs = self._load(args[0])
        with unmarked(args):
            graph = next((g for g in self.graphs if g.guard_check(*args)), None)
        if graph is not None:
            return graph
        if not self.compile_missing:
            return None
        graph = self._trace(args)
        self.graphs.append(graph)
        return graph

    def _trace(self, args: tuple[Any, ...]) -> Any:
        assert self.graphs is not None
        compiled = torch.compile(
            self.fn,
            fullgraph=True,
            dynamic=self._dynamic,
            backend=self.recorder.backend,
            options=self.recorder.options or None,
        )
        with _graph_name(self._free_name()), _singletons_by_name():
            graph = compiled.aot_compile((args, {}))  # type: ignore[attr-defined]
        self.traced += 1
        self._record(graph)
        self._save(graph, args[0])
        return graph

    def _free_name(self) -> str:
        """The graph's name: the same in every process that traces the same graphs in the same order (so
        inductor's cache finds them), and new to ``fn``'s module, where dynamo installs it while tracing."""
        n = 0
        while (name := f"__compiled_fn_{self.name}_{n}") in self.fn.__globals__:
            n += 1
        return name

    def _record(self, graph: Any) -> None:
        """Route the graph's calls through the recorder (the compiled function is a global of the code
        dynamo generated around it)."""
        backend_id = graph._artifacts.backend_id
        inner = graph.fn.__globals__[backend_id]
        graph.fn.__globals__[backend_id] = self.recorder.wrap(inner)

    def _files(self) -> list[Path]:
        if self.folder is None or not self.folder.is_dir():
            return []
        return sorted(self.folder.glob(f"{self.name}-*.graph"))

    def _load(self, model: torch.nn.Module) -> list[Any]:
        graphs = []
        for path in self._files():
            try:
                with path.open("rb") as f:
                    graph = torch.compiler.load_compiled_function(f, external_data={"model": model})
            except Exception:  # another torch wrote it, or a process died while writing: trace again
                log.warning("could not load the saved graph %s; it is traced again", path, exc_info=True)
                continue
            self._record(graph)
            graphs.append(graph)
        self.loaded += len(graphs)
        return graphs

    def _save(self, graph: Any, model: torch.nn.Module) -> None:
        if self.folder is None:
            return
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            data = type(graph).serialize(graph, {"model": model}).serialized_data
            digest = hashlib.sha256(data).hexdigest()[:16]
            path = self.folder / f"{self.name}-{digest}.graph"
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_bytes(data)
            tmp.replace(path)
        except Exception:
            log.warning("could not save a %s graph; a restart traces it again", self.name, exc_info=True)
