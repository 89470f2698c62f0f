"""The worker's compile policy: which steps run compiled for each set of flags and machines."""

from __future__ import annotations

import pytest
import torch

from hybridserve.config import CompileConfig, EngineConfig
from hybridserve.engine.worker.compile_policy import CompilePolicy
from hybridserve.models.interface import ModelInfo

INFO = ModelInfo("m", 16, 64, 8, (0,), (8,), compiled_steps=True)
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def _choose(
    config: CompileConfig, device: torch.device = CPU, ep: bool = False, spec: bool = False, info=INFO
):
    return CompilePolicy.choose(config, device, ep, info, spec)


@pytest.mark.parametrize(
    ("flags", "device", "expected"),
    [
        ((False, False, False), CPU, (False, False, False, False)),  # both switched off
        ((False, True, True), CPU, (True, True, True, True)),  # the default
        ((False, True, False), CPU, (True, True, False, True)),
        ((False, False, True), CPU, (False, False, True, True)),
        ((False, False, False), CUDA, (True, False, False, True)),  # CUDA graphs without compiling
        ((True, True, True), CUDA, (False, False, False, False)),  # --enforce-eager wins
    ],
)
def test_flags_and_device(flags: tuple[bool, bool, bool], device: torch.device, expected: tuple) -> None:
    p = _choose(CompileConfig(*flags), device)
    assert (p.decode_graphs, p.compile_decode, p.compile_prefill, p.compile_tail) == expected


def test_expert_parallel_speculative_and_modelless_compiles_stay_eager() -> None:
    both = CompileConfig(False, True, True)
    assert _choose(both, ep=True) == CompilePolicy(False, False, False, False)
    assert not _choose(CompileConfig(False, False, False), CUDA, spec=True).decode_graphs
    assert _choose(both, spec=True).decode_graphs  # --compile-decode: graphs for steps without drafts
    plain = ModelInfo("tiny", 16, 64, 8, (0,), (8,), compiled_steps=False)
    assert not _choose(both, info=plain).decode_graphs


def test_sub_configs_are_views_of_the_flat_config() -> None:
    config = EngineConfig(
        max_num_seqs=3, max_num_batched_tokens=77, compile_prefill=True, kv_cache_memory="2MiB"
    )
    assert (config.scheduler_config.max_num_seqs, config.scheduler_config.max_num_batched_tokens) == (3, 77)
    assert config.compile_config == CompileConfig(False, True, True)
    assert config.cache_config.layout == "arena" and config.cache_config.kv_cache_bytes == 2 << 20
    assert config.parallel_config.data_parallel_size == 1 and not config.parallel_config.expert_parallel
    assert config.disaggregation_config.mode is None and config.model_config.model == config.model


def test_compiled_by_default_enforce_eager_and_negated_switches() -> None:
    assert EngineConfig().compile_config == CompileConfig(False, True, True)
    assert EngineConfig(enforce_eager=True).compile_config == CompileConfig(True, False, False)
    assert EngineConfig(compile_decode=False).compile_config == CompileConfig(False, False, True)
    assert EngineConfig(compile_prefill=False).compile_config == CompileConfig(False, True, False)
    assert not EngineConfig(compile_decode=False, compile_prefill=False).compiles
    with pytest.raises(ValueError, match="--compile-decode with --enforce-eager"):
        EngineConfig(enforce_eager=True, compile_decode=True)


def test_cache_layout_with_compiled_steps() -> None:
    assert EngineConfig().resolved_cache_layout == "arena"  # the arena compiles (cache/flat_rows.py)
    assert EngineConfig(num_blocks=8).resolved_cache_layout == "fixed"
    assert EngineConfig(kv_cache_dtype="fp8").resolved_cache_layout == "fixed"  # two dtypes: fixed
    assert EngineConfig(kv_cache_dtype="fp8", enforce_eager=True).resolved_cache_layout == "arena"
    with pytest.raises(ValueError, match="fp8 with --cache-layout arena runs eagerly only"):
        EngineConfig(kv_cache_dtype="fp8", cache_layout="arena")
