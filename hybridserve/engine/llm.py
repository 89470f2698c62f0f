"""Offline batch inference with vLLM's shape: ``LLM(model=PATH, **engine_args).generate(prompts, params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from hybridserve.config import EngineConfig
from hybridserve.engine.core import EngineCore
from hybridserve.engine.dp_engine import DataParallelEngine
from hybridserve.engine.output_processor import OutputProcessor
from hybridserve.engine.request import FinishReason, Request, RequestOutput, SamplingParams
from hybridserve.tokenizer import Tokenizer, load_tokenizer

PromptType = str | list[int] | dict[str, Any]


class LLM:
    """Runs every prompt through one engine; all of them are batched together step by step."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        if model is not None:
            engine_args["model"] = model
        self.config = EngineConfig.from_kwargs(**engine_args)
        self.engine: EngineCore | DataParallelEngine = (
            DataParallelEngine(self.config) if self.config.data_parallel_size > 1 else EngineCore(self.config)
        )
        self.tokenizer = load_tokenizer(self.config.model)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine-core ranks (data-parallel engines run in their own processes)."""
        if isinstance(self.engine, DataParallelEngine):
            self.engine.close()

    def get_tokenizer(self) -> Tokenizer | None:
        return self.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        prompt_list = _as_list(prompts)
        params = _params_list(sampling_params, len(prompt_list))
        processor = OutputProcessor(self.tokenizer)
        order: list[str] = []
        for prompt, p in zip(prompt_list, params, strict=True):
            request = self._request(prompt, p)
            self.engine.add_request(request)
            processor.add_request(request)
            order.append(request.request_id)
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(order), desc="generating", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                outputs, stopped = processor.process(self.engine.step())
                for request_id, stop in stopped:
                    self.engine.finish_request(request_id, FinishReason.STOP, stop)
                for out in outputs:
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        return [done[i] for i in order]

    def _request(self, prompt: PromptType, params: SamplingParams) -> Request:
        request_id = str(next(self._ids))
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return Request(request_id, list(prompt["prompt_token_ids"]), params)
            prompt = str(prompt["prompt"])
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.config.model} ships no tokenizer.json: pass token-id prompts")
            return Request(request_id, self.tokenizer.encode(prompt), params, prompt=prompt)
        return Request(request_id, list(prompt), params)


def _as_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    items: list[Any] = list(prompts)
    if items and all(isinstance(x, int) for x in items):
        return [items]  # one prompt given as token ids
    return items


def _params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"{len(params)} sampling params for {n} prompts")
    return list(params)
