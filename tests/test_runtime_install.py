"""A runtime-only install (no [train] extra) imports every runtime module: no train-only dependency."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.source_imports import PACKAGE_ROOT, module_name, source_files

TRAIN_ONLY = ("transformers",)  # the [train] extra; its corpus tools are system binaries

_IMPORT_ALL = textwrap.dedent(
    """
    import importlib, importlib.abc, sys

    blocked, modules = set(sys.argv[1].split(",")), sys.argv[2:]

    class TrainOnly(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in blocked:
                raise ModuleNotFoundError(f"No module named {name!r} (train-only, blocked)", name=name)
            return None

    sys.meta_path.insert(0, TrainOnly())
    for name in modules:
        importlib.import_module(name)
    loaded = sorted(m for m in sys.modules if m.partition(".")[0] in blocked)
    assert not loaded, loaded
    print(len(modules), "modules imported")
    """
)


def runtime_modules() -> list[str]:
    train = PACKAGE_ROOT / "train"
    return [module_name(p) for p in source_files("") if train not in p.parents]


def test_every_runtime_module_imports_without_train_dependencies():
    modules = runtime_modules()
    assert "hybridserve.engine.core.engine_core" in modules
    assert not any(m.startswith("hybridserve.train") for m in modules)
    cmd = [sys.executable, "-c", _IMPORT_ALL, ",".join(TRAIN_ONLY), *modules]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=PACKAGE_ROOT.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{len(modules)} modules imported" in done.stdout


def test_the_block_is_real():
    """The same finder makes a train module fail to import (the test above can fail)."""
    cmd = [sys.executable, "-c", _IMPORT_ALL, ",".join(TRAIN_ONLY), "hybridserve.train.model"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=PACKAGE_ROOT.parent)
    assert done.returncode != 0 and "train-only, blocked" in done.stderr
