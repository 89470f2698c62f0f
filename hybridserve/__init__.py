"""hybridserve: an inference server for hybrid-attention MoE language models (DeepSeek-V4 first)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "EngineConfig", "RequestOutput", "SamplingParams"]

if TYPE_CHECKING:
    from hybridserve.config import EngineConfig
    from hybridserve.engine.llm import LLM
    from hybridserve.engine.request import RequestOutput, SamplingParams


def __getattr__(name: str) -> Any:  # lazy, so `import hybridserve` stays cheap
    if name == "LLM":
        from hybridserve.engine.llm import LLM

        return LLM
    if name in ("SamplingParams", "RequestOutput"):
        from hybridserve.engine import request

        return getattr(request, name)
    if name == "EngineConfig":
        from hybridserve.config import EngineConfig

        return EngineConfig
    raise AttributeError(name)
