"""Which steps run compiled, from the compile flags and what the engine runs on: the worker's decision,
in one place."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridserve.config import CompileConfig
from hybridserve.models.interface import ModelInfo


@dataclass(frozen=True)
class CompilePolicy:
    decode_graphs: bool  # pure-decode steps over bucketed static shapes (CUDA graphs on CUDA)
    compile_decode: bool  # ... and those through torch.compile
    compile_prefill: bool  # prefill and mixed steps through the one dynamic graph
    compile_tail: bool  # the eager steps' mHC tail compiled (one graph for every token count)

    @staticmethod
    def choose(
        config: CompileConfig, device: torch.device, expert_parallel: bool, info: ModelInfo, speculative: bool
    ) -> CompilePolicy:
        """Unless --enforce-eager: decode and prefill steps compiled (both by default, each may be switched
        off); on CUDA, or with either compiled, the mHC tail too. Expert-parallel steps exchange host-sized
        splits every MoE layer, so they stay eager. A speculative engine drafts most steps, so without
        --compile-decode its CUDA graphs are not worth their capture. A model without compiled steps
        (``ModelInfo.compiled_steps``; the flags that ask for them are refused at start-up) runs every step
        eagerly."""
        cuda = device.type == "cuda"
        accelerate = not config.enforce_eager and not expert_parallel and info.compiled_steps
        decode = accelerate and config.compile_decode
        prefill = accelerate and config.compile_prefill
        graphs = accelerate and (decode or (cuda and not speculative))
        return CompilePolicy(graphs, decode, prefill, accelerate and (cuda or decode or prefill))


EAGER = CompilePolicy(decode_graphs=False, compile_decode=False, compile_prefill=False, compile_tail=False)
