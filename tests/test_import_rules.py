"""The package's layering, as rules over every import (lazy ones too), read from the source (ast).

From the bottom: distributed/ (process groups, step sync, expert dispatch) and cache/ (the cache plan
and its memory) know nothing above them; layers/ knows no model; models/ knows no engine; the engine
reaches models only through the registry and the model interface; server/ and router/ see only the
engine's front; bench/ talks HTTP; nothing that serves imports train/. And no two modules import each
other, directly or not.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.source_imports import imported_modules, module_name, source_files, within

PACKAGES = (
    "distributed",
    "cache",
    "layers",
    "models",
    "engine",
    "kv_transfer",
    "server",
    "router",
    "bench",
    "train",
)
# What each package may not import (besides itself); shared modules (config, tokenizer) are open to all.
FORBIDDEN = {
    "distributed": (
        "cache",
        "layers",
        "models",
        "engine",
        "kv_transfer",
        "server",
        "router",
        "bench",
        "train",
    ),
    "cache": ("layers", "models", "engine", "kv_transfer", "server", "router", "bench", "train"),
    "layers": ("cache", "models", "engine", "kv_transfer", "server", "router", "bench", "train"),
    "models": ("engine", "kv_transfer", "server", "router", "bench", "train"),
    "kv_transfer": ("layers", "models", "server", "router", "bench", "train"),
    "engine": ("server", "router", "bench", "train"),
    "server": ("cache", "layers", "models", "distributed", "router", "bench", "train"),
    "router": ("cache", "layers", "models", "distributed", "engine", "kv_transfer", "bench", "train"),
    "bench": (
        "cache",
        "layers",
        "models",
        "distributed",
        "engine",
        "kv_transfer",
        "server",
        "router",
        "train",
    ),
}
# The engine's front: what the API process may import of it. Everything else is the engine's own.
ENGINE_FRONT = tuple(
    f"hybridserve.engine.{m}"
    for m in ("async_llm", "request", "errors", "stats", "limits", "outputs", "sample.structured_outputs")
)


def _cases(packages: tuple[str, ...]) -> Iterator[tuple[str, Path]]:
    for package in packages:
        yield from ((package, path) for path in source_files(package))


@pytest.mark.parametrize(
    ("package", "path"), list(_cases(tuple(FORBIDDEN))), ids=lambda v: v if isinstance(v, str) else v.name
)
def test_no_package_imports_above_itself(package: str, path: Path) -> None:
    bad = [
        (line, m)
        for line, m in imported_modules(path)
        if any(within(m, f"hybridserve.{up}") for up in FORBIDDEN[package])
    ]
    assert not bad, f"{package}/{path.name} imports what {package}/ must not know: {bad}"


# What the engine may import of models/: the model interface and the registry that hands models out.
MODEL_FRONT = ("hybridserve.models.interface", "hybridserve.models.registry")


@pytest.mark.parametrize("path", source_files("engine"), ids=lambda p: p.name)
def test_the_engine_reaches_models_only_through_the_registry(path: Path) -> None:
    named = [
        (line, m)
        for line, m in imported_modules(path)
        if within(m, "hybridserve.models") and not any(within(m, front) for front in MODEL_FRONT)
    ]
    assert not named, f"engine/{path.name} names a model (use models.registry / models.interface): {named}"


@pytest.mark.parametrize("path", source_files("server") + source_files("router"), ids=lambda p: p.name)
def test_the_api_process_sees_only_the_engines_front(path: Path) -> None:
    inside = [
        (line, m)
        for line, m in imported_modules(path)
        if within(m, "hybridserve.engine")
        and m != "hybridserve.engine"
        and not any(within(m, front) for front in ENGINE_FRONT)
    ]
    assert not inside, f"{path.name} imports engine internals: {inside}"


def test_nothing_that_serves_imports_train() -> None:
    serving = [p for pkg in PACKAGES if pkg != "train" for p in source_files(pkg)]
    serving += [p for p in source_files("") if p.parent.name == "hybridserve"]
    bad = [
        (module_name(p), m) for p in serving for _, m in imported_modules(p) if within(m, "hybridserve.train")
    ]
    assert not bad, f"serving code imports train/: {bad}"


def _import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in source_files("")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for name, path in files.items():
        for _, imported in imported_modules(path):
            while imported and imported not in files:
                imported = imported.rpartition(".")[0]
            if imported and imported != name and files[imported].name != "__init__.py":
                graph[name].add(imported)
    return graph


def _cycle_from(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """A path start -> ... -> start, if there is one (depth-first)."""
    stack, seen = [(start, [start])], set()
    while stack:
        node, path = stack.pop()
        for nxt in graph[node]:
            if nxt == start:
                return [*path, start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, [*path, nxt]))
    return None


def test_no_import_circles() -> None:
    graph = _import_graph()
    circles = [c for c in (_cycle_from(graph, m) for m in sorted(graph)) if c]
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles[:5])


def test_the_rules_see_a_circle(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _cycle_from({"a": {"b"}, "b": {"c"}, "c": {"a"}}, "a") == ["a", "b", "c", "a"]
    assert _cycle_from({"a": {"b"}, "b": set()}, "a") is None


def test_the_walk_sees_relative_and_lazy_imports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tests.source_imports as si

    pkg = tmp_path / "hybridserve" / "layers"
    pkg.mkdir(parents=True)
    (pkg / "x.py").write_text("def f():\n    from ..models import deepseek_v4\n")
    monkeypatch.setattr(si, "PACKAGE_ROOT", tmp_path / "hybridserve")
    assert "hybridserve.models.deepseek_v4" in {m for _, m in imported_modules(pkg / "x.py")}
