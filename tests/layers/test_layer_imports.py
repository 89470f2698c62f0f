"""layers/ holds building blocks that know no model: it imports nothing above it."""

from __future__ import annotations

import pytest

from tests.source_imports import imported_modules, source_files, within

ABOVE_LAYERS = tuple(
    f"hybridserve.{p}" for p in ("models", "engine", "server", "cache", "distributed", "bench", "train")
)


@pytest.mark.parametrize("path", source_files("layers"), ids=lambda p: p.name)
def test_layers_import_nothing_above_them(path):
    bad = [(line, m) for line, m in imported_modules(path) if any(within(m, up) for up in ABOVE_LAYERS)]
    assert not bad, f"{path.name} imports from above layers/: {bad}"


def test_the_walk_sees_relative_and_lazy_imports(tmp_path, monkeypatch):
    import tests.source_imports as si

    pkg = tmp_path / "hybridserve" / "layers"
    pkg.mkdir(parents=True)
    (pkg / "x.py").write_text("def f():\n    from ..models import deepseek_v4\n")
    monkeypatch.setattr(si, "PACKAGE_ROOT", tmp_path / "hybridserve")
    assert "hybridserve.models.deepseek_v4" in {m for _, m in imported_modules(pkg / "x.py")}
