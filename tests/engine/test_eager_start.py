"""What a start-up imports. An eager engine never imports the compiler stack: ``torch._dynamo`` costs
~1.5 s of every start-up (and every eager server process in the test suite) that ``enforce_eager`` never
uses; a compiling one imports it only once it compiles."""

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


CORE_PROGRAM = """
import sys
from hybridserve.config import EngineConfig
from hybridserve.engine.core.engine_core import EngineCore
from hybridserve.engine.request import StructuredOutputsParams
own = sys.argv[2] == "own"
core = EngineCore(EngineConfig(model=sys.argv[1], block_tokens=8), own_process=own)
print("ready", "torch._dynamo" in sys.modules, "xgrammar" in sys.modules, flush=True)
if own:  # as process.py does once the core is ready
    core.structured.warm_up()
else:
    core.grammar_warm_up.join(60)
core.structured.compile(StructuredOutputsParams(json_object=True))
print("grammar compiler builds", core.structured.compiler_builds)
"""


def test_a_compiling_engine_core_of_its_own_is_ready_before_the_compiler_and_xgrammar_load(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    """Compiled by default, an engine-core process is ready before it imports the compiler (its
    compile, after, does) or xgrammar (its grammar warm-up, after, does, and builds the one grammar
    compiler); an engine in the caller's process imports xgrammar before it returns (the caller's threads
    may import transformers, whose lazy module two threads must not import at once)."""
    folder = str(tiny_checkpoint("mixed"))
    for where, ready in (("own", "ready False False"), ("caller", "ready False True")):
        cmd = [sys.executable, "-c", CORE_PROGRAM, folder, where]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False)
        assert run.returncode == 0, run.stderr
        lines = run.stdout.strip().splitlines()
        assert lines[0] == ready
        assert lines[-1] == "grammar compiler builds 1"
