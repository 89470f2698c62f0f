"""An eager engine never imports the compiler stack: ``torch._dynamo`` costs ~1.5 s of every start-up
(and every eager server process in the test suite) that ``enforce_eager`` never uses."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

PROGRAM = """
import sys
from hybridserve import LLM, SamplingParams
llm = LLM(sys.argv[1], block_tokens=8, enforce_eager=True)
out = llm.generate([[5, 7, 9, 11] * 6, [3, 4]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
assert all(len(o.outputs[0].token_ids) == 4 for o in out)
print(sorted(m for m in sys.modules if m.startswith("torch._dynamo")))
"""


def test_an_eager_engine_does_not_import_the_compiler(tiny_checkpoint: Callable[[str], Path]) -> None:
    folder = tiny_checkpoint("mixed")
    run = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(folder)], capture_output=True, text=True, timeout=120, check=False
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "[]"
