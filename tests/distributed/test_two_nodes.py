"""Two "hosts" on one machine: the head (API side, rank 0) and ``hybridserve serve --headless`` (rank 1),
joined only by --data-parallel-address / --data-parallel-rpc-port."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch

from hybridserve import LLM, SamplingParams
from tests.reference import reference_greedy
from tests.tiny_models import VOCAB


def free_port_run(n: int) -> int:
    """A port P with P .. P+n-1 all free now."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        with ExitStack() as stack:
            try:
                for p in range(base, base + n):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", p))
            except OSError:
                continue
        return base


def test_head_and_headless_node_serve_together(tiny_checkpoint: Callable[[str], Path]) -> None:
    folder = tiny_checkpoint("mixed")
    port = free_port_run(4)  # store, outputs, inputs of rank 0 and 1
    common = dict(data_parallel_size=2, data_parallel_size_local=1, data_parallel_rpc_port=port)
    node = subprocess.Popen(
        [sys.executable, "-m", "hybridserve.cli", "serve", "--headless", "--model", str(folder),
         "--enable-expert-parallel", "--data-parallel-size", "2", "--data-parallel-size-local", "1",
         "--data-parallel-start-rank", "1", "--data-parallel-address", "127.0.0.1",
         "--data-parallel-rpc-port", str(port), "--num-threads", "1"],
    )  # fmt: skip
    try:
        llm = LLM(str(folder), enable_expert_parallel=True, **common, enforce_eager=True)  # type: ignore[arg-type]
        g = torch.Generator().manual_seed(9)
        prompts = [torch.randint(3, VOCAB, (k,), generator=g).tolist() for k in (7, 30, 12)]
        try:
            outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
            ranks = llm.engine.client.rank_stats  # type: ignore[union-attr]
        finally:
            llm.shutdown()
        assert node.wait(timeout=30) == 0  # the head's shutdown stops the remote rank too
        assert set(ranks) == {0, 1} and all(s.generation_tokens > 0 for s in ranks.values())
        for prompt, out in zip(prompts, outputs, strict=True):
            assert out.outputs[0].token_ids == reference_greedy(folder, prompt, 8)
    finally:
        if node.poll() is None:
            node.kill()
            node.wait(10)
