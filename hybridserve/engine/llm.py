"""Offline batch inference with vLLM's shape: ``LLM(model=PATH, **engine_args).generate(prompts, params)``."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from tqdm import tqdm

from hybridserve.config import EngineConfig
from hybridserve.engine.client.dp_engine import DataParallelEngine
from hybridserve.engine.core.engine_core import EngineCore
from hybridserve.engine.output_processor import OutputProcessor
from hybridserve.engine.request import FinishReason, Request, RequestOutput, RequestOutputKind, SamplingParams
from hybridserve.tokenizer import Tokenizer, load_chat_template, load_tokenizer

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
        self.tokenizer = load_tokenizer(self.config.model, self.config.tokenizer_mode)
        self._ids = itertools.count()
        if isinstance(self.engine, EngineCore):  # data-parallel ranks warm up in their own processes
            _warm_up(self.engine, show=self.config.compiles)

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
        order: list[list[str]] = []  # per prompt, its n requests
        try:
            for prompt, p in zip(prompt_list, params, strict=True):
                order.append([self._add(self._request(prompt, q), processor) for q in _choices(p)])
            done = self._run(processor, sum(map(len, order)), use_tqdm)
        except BaseException:
            for request_id in (r for rs in order for r in rs):
                self.engine.abort_request(request_id)
            raise
        return [_merged([done[r] for r in rs]) for rs in order]

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of messages) or to several, in the chat template
        (``chat_template`` instead of the checkpoint's, if given; ``tools`` as OpenAI tool definitions;
        ``chat_template_kwargs`` e.g. ``{"thinking": False}`` in DeepSeek-V4's format)."""
        if self.tokenizer is None:
            raise ValueError(f"{self.config.model} ships no tokenizer.json, so chat is unavailable")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.tokenizer
        if chat_template is not None:
            tokenizer = copy.copy(self.tokenizer)
            tokenizer.chat_template = load_chat_template(chat_template)
            tokenizer.mode = "hf"
        extra = {**(chat_template_kwargs or {}), **({"tools": tools} if tools else {})}
        prompts: list[PromptType] = []
        for conversation in conversations:
            ids, _ = tokenizer.encode_chat(list(conversation), add_generation_prompt, **extra)  # type: ignore[arg-type]
            prompts.append({"prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _add(self, request: Request, processor: OutputProcessor) -> str:
        self.engine.add_request(request)
        processor.add_request(request)
        return request.request_id

    def _run(self, processor: OutputProcessor, total: int, use_tqdm: bool) -> dict[str, RequestOutput]:
        done: dict[str, RequestOutput] = {}
        with tqdm(total=total, desc="generating", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                outputs, stopped = processor.process(self.engine.step())
                for request_id, stop in stopped:
                    self.engine.finish_request(request_id, FinishReason.STOP, stop)
                for out in outputs:
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        return done

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


def _choices(params: SamplingParams) -> list[SamplingParams]:
    """One request per choice, each making only its final output (all ``generate`` returns); with a
    seed, choice j draws with seed + j (as the server does)."""
    final = replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
    if final.n == 1:
        return [final]
    return [final if final.seed is None else replace(final, seed=final.seed + j) for j in range(final.n)]


def _merged(outs: list[RequestOutput]) -> RequestOutput:
    """The n outputs of one prompt as one RequestOutput (vLLM's shape: ``outputs[j]`` is choice j)."""
    first = outs[0]
    completions = [replace(o.outputs[0], index=j) for j, o in enumerate(outs)]
    return replace(first, outputs=completions, finished=all(o.finished for o in outs))


def _warm_up(engine: EngineCore, show: bool) -> None:
    """Compile the engine's graphs now, as the server does at start-up, so that no generate call stops to
    compile in the middle of its work; a progress bar while it does."""
    with tqdm(total=engine.runner.warmup_part_count(), desc="Compiling", disable=not show) as bar:
        engine.warmup(progress=lambda name: (bar.set_postfix_str(name), bar.update())[-1])


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
