"""Oracle drafts in engine-core rank processes, through $HYBRIDSERVE_PLUGINS: ``install`` reads the
continuations from the JSON file named by $HYBRIDSERVE_TEST_ORACLE (prompt -> greedy tokens) and keeps
``oracle_drafts`` (tests/engine/spec_decode/spec_helpers.py) on for the life of the process."""

from __future__ import annotations

import json
import os
from contextlib import AbstractContextManager
from pathlib import Path

from tests.engine.spec_decode.spec_helpers import oracle_drafts

ORACLE_ENV = "HYBRIDSERVE_TEST_ORACLE"
_INSTALLED: list[AbstractContextManager[None]] = []  # a collected context manager would undo itself


def write_oracle(path: Path, prompts: list[list[int]], tokens: list[list[int]]) -> None:
    path.write_text(json.dumps([[p, t] for p, t in zip(prompts, tokens, strict=True)]))


def install() -> None:
    pairs = json.loads(Path(os.environ[ORACLE_ENV]).read_text())
    oracle = oracle_drafts({tuple(p): t for p, t in pairs})
    oracle.__enter__()
    _INSTALLED.append(oracle)
