"""Small hand-made cache specs (the cache layer knows nothing about DeepSeek)."""

from __future__ import annotations

import torch

from hybridserve.cache.spec import CacheGroupSpec, GroupKind, RowField


def toy_specs(window: int = 5, rate: int = 4) -> list[CacheGroupSpec]:
    f = (RowField("kv", 2, torch.float32),)
    return [
        CacheGroupSpec("win", GroupKind.WINDOW, 1, f, ("l0", "l1"), window_tokens=window),
        CacheGroupSpec("state", GroupKind.WINDOW, 1, f, ("l1",), window_tokens=2 * rate - 1),
        CacheGroupSpec("rows", GroupKind.HISTORY, rate, f, ("l1",)),
    ]
