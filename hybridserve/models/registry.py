"""model_type -> (config parser, model class)."""

from __future__ import annotations

from typing import Any

from hybridserve.models.deepseek_v4 import DeepseekV4Model
from hybridserve.models.deepseek_v4_config import DeepseekV4Config

MODELS: dict[str, tuple[Any, Any]] = {
    "deepseek_v4": (DeepseekV4Config, DeepseekV4Model),
}


def resolve(model_type: str | None) -> tuple[Any, Any]:
    if model_type not in MODELS:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {sorted(MODELS)}")
    return MODELS[model_type]
