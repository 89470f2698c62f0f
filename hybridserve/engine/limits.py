"""RequestLimits: what a request may ask of this engine. The core and the API process check the same."""

from __future__ import annotations

from dataclasses import dataclass

from hybridserve.engine.errors import RequestRejected
from hybridserve.engine.request import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int
    max_pool_tokens: int  # what the KV pools can hold for one request

    @property
    def max_request_tokens(self) -> int:
        """Longest prompt + output a request may ask for: the model's and the pools' limits."""
        return min(self.max_model_len, self.max_pool_tokens)

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestRejected if the request can never be served as asked."""
        self._check_prompt(prompt_token_ids)
        self._check_params(params)
        self._check_length(len(prompt_token_ids), params.max_tokens)

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise RequestRejected("the prompt is empty")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise RequestRejected(f"prompt token ids must be in [0, {self.vocab_size})")

    def _check_params(self, params: SamplingParams) -> None:
        vocab = self.vocab_size
        if params.top_k > vocab:
            raise RequestRejected(
                f"top_k must be at most the vocabulary size {vocab}", "invalid_value", "top_k"
            )
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise RequestRejected(
                f"stop_token_ids must be in [0, {vocab})", "invalid_value", "stop_token_ids"
            )
        if any(not 0 <= t < vocab for t in params.logit_bias or {}):
            raise RequestRejected(
                f"logit_bias token ids must be in [0, {vocab})", "invalid_value", "logit_bias"
            )

    def _check_length(self, num_prompt: int, max_tokens: int | None) -> None:
        limit = self.max_request_tokens
        total = num_prompt + (max_tokens or 1)
        if total > limit:
            raise RequestRejected(
                f"prompt has {num_prompt:,} tokens and max_tokens is {max_tokens or 0:,}: "
                f"{total:,} in all, but this server holds at most {limit:,} per request "
                f"(max_model_len {self.max_model_len:,}, KV pool {self.max_pool_tokens:,}; "
                f"shorten the prompt, lower max_tokens, or raise --kv-cache-memory / --max-model-len)",
                code="context_length_exceeded",
            )
