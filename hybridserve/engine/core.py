"""EngineCore: add_request / abort_request / step() -> token outputs. No asyncio, no HTTP, no text."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from hybridserve.cache.coordinator import KvCacheCoordinator
from hybridserve.cache.plan import CachePlan, build_plan
from hybridserve.cache.pool import BlockPoolSet
from hybridserve.config import EngineConfig
from hybridserve.engine.request import FinishReason, Logprob, Request
from hybridserve.engine.runner import ModelRunner
from hybridserve.engine.sampler import Sampler, SampleResult
from hybridserve.engine.scheduler import Scheduler
from hybridserve.models.loader import load_model, read_config


class RequestRejected(ValueError):
    """A request that can never be served as asked (too long, bad token ids, duplicate id)."""

    def __init__(self, message: str, code: str = "invalid_prompt") -> None:
        super().__init__(message)
        self.code = code


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0


@dataclass
class EngineStats:
    generation_tokens: int = 0
    steps: int = 0
    finished: dict[str, int] = field(default_factory=dict)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.torch_device()
        raw = read_config(config.model)
        self.dtype = config.torch_dtype(raw.get("dtype") or raw.get("torch_dtype"))
        self.model = load_model(config.model, self.dtype, self.device)
        self.plan = self._build_plan()
        self.pools = BlockPoolSet(self.plan, self.device)
        self.coordinator = KvCacheCoordinator(self.plan, self.pools, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.coordinator, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, self.pools, self.coordinator, Sampler(config.seed), self.device)
        self.max_model_len = config.max_model_len or self.model.cfg.max_position_embeddings
        self.eos_token_ids = _eos_token_ids(Path(config.model), self.model.cfg.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()

    def _build_plan(self) -> CachePlan:
        specs = self.model.cache_specs()
        block_tokens = self.config.resolve_block_tokens([s.stride for s in specs])
        return build_plan(
            specs,
            block_tokens,
            self.config.max_num_seqs,
            self.config.max_num_batched_tokens,
            memory_bytes=self.config.kv_cache_bytes,
            num_blocks=self.config.num_blocks,
            window_cache_share=self.config.window_cache_share if self.config.enable_prefix_caching else 0.0,
        )

    @property
    def max_request_tokens(self) -> int:
        """Longest prompt + output a request may ask for: the model's and the pools' limits."""
        return min(self.max_model_len, self.plan.max_request_tokens())

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.validate(request)
        request.max_tokens = request.params.max_tokens or self.max_request_tokens - len(
            request.prompt_token_ids
        )
        request.eos_token_ids = self.eos_token_ids
        self.requests[request.request_id] = request
        self.scheduler.add(request)

    def validate(self, request: Request) -> None:
        """Raise RequestRejected if ``request`` can never be served as asked."""
        ids = request.prompt_token_ids
        if request.request_id in self.requests:
            raise RequestRejected(f"request id {request.request_id!r} is already in use")
        if not ids:
            raise RequestRejected("the prompt is empty")
        vocab = self.model.cfg.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise RequestRejected(f"prompt token ids must be in [0, {vocab})")
        limit = self.max_request_tokens
        total = len(ids) + (request.params.max_tokens or 1)
        if total > limit:
            raise RequestRejected(
                f"prompt has {len(ids):,} tokens and max_tokens is {request.params.max_tokens or 0:,}: "
                f"{total:,} in all, but this server holds at most {limit:,} per request "
                f"(max_model_len {self.max_model_len:,}, KV pool {self.plan.max_request_tokens():,}; "
                f"shorten the prompt, lower max_tokens, or raise --kv-cache-memory / --max-model-len)",
                code="context_length_exceeded",
            )

    def abort_request(self, request_id: str) -> bool:
        """Finish a request now and free its blocks; False if it is unknown or already done."""
        return self.finish_request(request_id, FinishReason.ABORT)

    def finish_request(
        self, request_id: str, reason: FinishReason, stop_reason: int | str | None = None
    ) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        req.finish(reason, stop_reason)
        self.scheduler.finish(req)
        self._count_finish(reason)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- stepping ----------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        out = self.scheduler.schedule()
        if not out.scheduled:
            return []
        self.stats.steps += 1
        results = iter(self.runner.execute(out))
        outputs: list[EngineCoreOutput] = []
        for s in out.scheduled:
            req = s.request
            req.num_computed_tokens = s.end
            self.coordinator.publish(req.request_id, req.all_token_ids, s.end)
            if s.samples:
                outputs.append(self._append_token(req, next(results)))
        return outputs

    def _append_token(self, req: Request, res: SampleResult) -> EngineCoreOutput:
        req.output_token_ids.append(res.token_id)
        self.stats.generation_tokens += 1
        logprobs = [res.top] if res.top is not None else None
        reason, stop_reason = self._stop(req, res.token_id)
        if reason is not None:
            self.finish_request(req.request_id, reason, stop_reason)
        return EngineCoreOutput(
            req.request_id, [res.token_id], logprobs, reason, stop_reason, req.num_cached_tokens
        )

    def _stop(self, req: Request, token: int) -> tuple[FinishReason | None, int | str | None]:
        p = req.params
        n_out = len(req.output_token_ids)
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in req.eos_token_ids:
                return FinishReason.STOP, None
            if token in p.stop_token_ids:
                return FinishReason.STOP, token
        if n_out >= req.max_tokens or req.num_tokens >= self.max_request_tokens:
            return FinishReason.LENGTH, None
        return None, None

    def _count_finish(self, reason: FinishReason) -> None:
        self.stats.finished[reason.value] = self.stats.finished.get(reason.value, 0) + 1

    def reset_prefix_cache(self) -> None:
        self.coordinator.reset_prefix_cache()


def _eos_token_ids(folder: Path, fallback: tuple[int, ...]) -> tuple[int, ...]:
    path = folder / "generation_config.json"
    if path.is_file():
        eos = json.loads(path.read_text()).get("eos_token_id")
        if eos is not None:
            return tuple(eos) if isinstance(eos, list) else (int(eos),)
    return fallback
