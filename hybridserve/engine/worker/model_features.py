"""The engine features a model supports (``ModelInfo``): the rest are refused at start-up, naming the
model and the fix, before anything is allocated."""

from __future__ import annotations

from hybridserve.config import EngineConfig
from hybridserve.models.interface import ModelInfo


def check_features(config: EngineConfig, info: ModelInfo) -> None:
    """Raise ValueError for the first flag of ``config`` that the model of ``info`` cannot serve."""
    spec = config.speculative
    if spec is not None and not info.num_draft_layers:
        raise ValueError(
            f"speculative_config method {spec.method!r} needs MTP weights (mtp.0.*), and "
            f"{config.model} ({info.name}) has none; serve it without --speculative-config"
        )
    if config.kv_cache_dtype not in info.kv_cache_dtypes:
        raise ValueError(
            f"--kv-cache-dtype {config.kv_cache_dtype}: {info.name} supports only "
            f"{', '.join(info.kv_cache_dtypes)}; serve {config.model} with --kv-cache-dtype auto"
        )
    asked = {"--compile-decode": config.compile_decode, "--compile-prefill": config.compile_prefill}
    for flag, on in asked.items():  # by default (None) such a model runs eagerly
        if on and not info.compiled_steps:
            raise ValueError(f"{flag}: {info.name} has no compiled steps; serve {config.model} without it")
    if config.expert_parallel and not info.expert_parallel:
        raise ValueError(
            f"--enable-expert-parallel: {info.name} has no routed experts to split across ranks; serve "
            f"{config.model} without it"
        )
