"""The engine's cache plan for a model: the one place that turns the engine's flags into a CachePlan.

EngineCore and ``hybridserve plan`` both call ``plan_cache``, so what the plan command prints is what
an engine started with the same flags allocates (every data-parallel rank builds the same plan).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from hybridserve.cache.plan import CachePlan, build_plan
from hybridserve.cache.spec import CacheGroupSpec
from hybridserve.config import WINDOW_CACHE_SHARE_DEFAULT, CacheConfig, EngineConfig, SchedulerConfig
from hybridserve.engine.worker.model_features import check_features
from hybridserve.layers.fp8_rows import fp8_supported
from hybridserve.models.interface import PagedModel

log = logging.getLogger("hybridserve.engine")


def plan_cache(config: EngineConfig, model: PagedModel[Any], device: torch.device | None) -> CachePlan:
    """Size every cache group of ``model`` (loaded, or built on the meta device) from ``config``, once the
    model is known to support every feature ``config`` asks for (``check_features``).

    ``device``: where the pools will live, checked for FP8 storage (None: not checked).
    """
    if config.kv_cache_dtype == "fp8" and device is not None and (why := fp8_supported(device)) is not None:
        raise ValueError(
            f"--kv-cache-dtype fp8: {device} cannot store float8_e4m3fn tensors ({why}); serve "
            "with --kv-cache-dtype auto, which keeps the cache in the model dtype (about twice the bytes "
            "per token)"
        )
    check_features(config, model.info)
    specs = model.cache_specs(
        include_mtp=config.speculative is not None, kv_cache_dtype=config.kv_cache_dtype
    )
    return build_cache_plan(config.cache_config, config.scheduler_config, specs)


def build_cache_plan(
    cache: CacheConfig, scheduler: SchedulerConfig, specs: list[CacheGroupSpec]
) -> CachePlan:
    """The cache plan for ``specs``: what the engine serves with, and `hybridserve plan` prints."""
    share = cache.window_cache_share if cache.enable_prefix_caching else 0.0
    if cache.layout == "arena" and cache.window_cache_share != WINDOW_CACHE_SHARE_DEFAULT:
        log.warning(
            "--window-cache-share %s is ignored with --cache-layout arena (cache groups take pages as they "
            "need them); pass --cache-layout fixed for a fixed split",
            cache.window_cache_share,
        )
    return build_plan(
        specs,
        cache.resolve_block_tokens([s.stride for s in specs]),
        scheduler.max_num_seqs,
        scheduler.max_num_batched_tokens,
        memory_bytes=cache.kv_cache_bytes,
        num_blocks=cache.num_blocks,
        window_cache_share=share,
        layout=cache.layout,
    )
