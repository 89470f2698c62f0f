"""EngineCoreOutput: what one engine-core step says about one request (token ids, not text)."""

from __future__ import annotations

from dataclasses import dataclass

from hybridserve.engine.request import FinishReason, Logprob
from hybridserve.kv_transfer.records import KvHandoff


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # set with FinishReason.ERROR: why the request's step failed
    handoff_failed: bool = False  # with error: its KV handoff failed (a 503 to retry), not a step
    kv_transfer: KvHandoff | None = None  # prefill worker: the request's blocks wait to be pulled
    kv_handoff_seconds: float | None = None  # decode worker: the pull of its blocks (first step after)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # with the first token only
