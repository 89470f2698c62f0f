"""Turns EngineCore token outputs into RequestOutputs: text, stop strings, logprobs, stream deltas.

Text that might be the start of a stop string is held back until it is known not to be one, so
a stop string is never streamed to the client.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridserve.engine.outputs import EngineCoreOutput
from hybridserve.engine.request import (
    CompletionOutput,
    FinishReason,
    Logprob,
    Request,
    RequestOutput,
    RequestOutputKind,
    SampleLogprobs,
)
from hybridserve.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class RequestState:
    request: Request
    detokenizer: IncrementalDetokenizer | None
    text: str = ""
    sent_chars: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0  # as the engine reports it (the request object may live in another process)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def holdback(self) -> int:
        stops = self.request.params.stop
        return max((len(s) for s in stops), default=1) - 1


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(self, request: Request) -> None:
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, request.params.skip_special_tokens
            )
        state = RequestState(request, detok)
        if request.params.logprobs is not None:
            state.logprobs, state.cumulative_logprob = [], 0.0
        self.states[request.request_id] = state

    def abort_request(self, request_id: str) -> RequestOutput | None:
        state = self.states.pop(request_id, None)
        if state is None:
            return None
        state.finish_reason = FinishReason.ABORT.value
        return self._output(state, [], finished=True)

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[tuple[str, str]]]:
        """-> (request outputs, (request id, stop string) of requests a stop string has finished)."""
        results: list[RequestOutput] = []
        stopped: list[tuple[str, str]] = []
        for out in outputs:
            state = self.states.get(out.request_id)
            if state is None:
                continue
            hit, new_ids = self._update(state, out)
            if hit is not None:
                stopped.append((out.request_id, hit))
            finished = state.finish_reason is not None
            if finished or state.request.params.output_kind != RequestOutputKind.FINAL_ONLY:
                results.append(self._output(state, new_ids, finished))
            if finished:
                del self.states[out.request_id]
        return results, stopped

    def _update(self, state: RequestState, out: EngineCoreOutput) -> tuple[str | None, list[int]]:
        """-> (the stop string hit, the tokens kept). A step may bring several tokens (speculative
        decoding): a stop string ends the output at the token that completes it, as one token per
        step would."""
        state.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            for entry in out.prompt_logprobs:
                self._name_tokens(entry or {})
            state.prompt_logprobs = out.prompt_logprobs
        if out.finish_reason is not None:
            state.finish_reason, state.stop_reason = out.finish_reason.value, out.stop_reason
        logprobs = out.new_logprobs if state.logprobs is not None else None
        for n, tok in enumerate(out.new_token_ids):
            state.token_ids.append(tok)
            if logprobs is not None:
                self._add_logprobs(state, tok, logprobs[n])
            if state.detokenizer is None:
                continue
            before = len(state.text)
            state.text += state.detokenizer.step(tok)
            hit = self._find_stop(state, before)
            if hit is not None:
                state.finish_reason, state.stop_reason = FinishReason.STOP.value, hit
                return hit, out.new_token_ids[: n + 1]
        return None, out.new_token_ids

    def _add_logprobs(self, state: RequestState, tok: int, entry: dict) -> None:
        assert state.logprobs is not None
        self._name_tokens(entry)
        state.logprobs.append(entry)
        state.cumulative_logprob = (state.cumulative_logprob or 0.0) + entry[tok].logprob

    def _find_stop(self, state: RequestState, before: int) -> str | None:
        params = state.request.params
        best: tuple[int, str] | None = None
        for stop in params.stop:
            idx = state.text.find(stop, max(0, before - len(stop) + 1))
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        state.text = state.text[: idx + (len(stop) if params.include_stop_str_in_output else 0)]
        return stop

    def _name_tokens(self, entry: dict) -> None:
        if self.tokenizer is not None:
            for tid, lp in entry.items():
                lp.decoded_token = self.tokenizer.token_text(tid)

    def _output(self, state: RequestState, new_ids: list[int], finished: bool) -> RequestOutput:
        visible = len(state.text) if finished else max(state.sent_chars, len(state.text) - state.holdback)
        delta = state.text[state.sent_chars : visible]
        state.sent_chars = visible
        req = state.request
        lps = state.logprobs
        new_logprobs = None if lps is None else lps[max(0, len(lps) - len(new_ids)) :]
        if req.params.output_kind == RequestOutputKind.DELTA:
            completion = self._completion(state, delta, list(new_ids), new_logprobs)
        else:  # snapshots, like the text: a stream reader a step behind must not see the next step's entries
            logprobs = None if state.logprobs is None else list(state.logprobs)
            text = state.text if finished else state.text[:visible]
            completion = self._completion(state, text, list(state.token_ids), logprobs)
        return RequestOutput(
            req.request_id,
            req.prompt,
            req.prompt_token_ids,
            [completion],
            finished,
            state.num_cached_tokens,
            list(new_ids),
            delta,
            new_logprobs,
            state.prompt_logprobs,
            num_output_tokens=len(state.token_ids),
        )

    @staticmethod
    def _completion(
        state: RequestState, text: str, token_ids: list[int], logprobs: SampleLogprobs | None
    ) -> CompletionOutput:
        return CompletionOutput(
            index=0,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=state.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=state.finish_reason,
            stop_reason=state.stop_reason,
        )
