"""Request state, sampling parameters and the outputs handed back to users (vLLM's shapes)."""

from __future__ import annotations

import operator
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum, IntEnum, StrEnum
from typing import Any, Self, SupportsIndex

import torch

from hybridserve.kv_transfer.records import KvHandoff


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"  # the step that ran the request failed; the engine went on without it


class RequestOutputKind(IntEnum):
    """Which outputs a request gets and what they hold (vLLM's kinds): every step's output with
    everything so far; every step's output with only what the step added; or only the final output (with
    everything). DELTA and FINAL_ONLY spare copying a growing output into each step's output."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class StructuredOutputsParams:
    """One output constraint (vLLM's shape): a JSON schema, any JSON object, a regex, one of some
    strings, an EBNF grammar (GBNF / xgrammar dialect) or a structural tag."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | None = None  # xgrammar's structural tag, as JSON (tool calls use it)

    def __post_init__(self) -> None:
        given = [self.json is not None, self.regex is not None, self.choice is not None]
        given += [self.grammar is not None, self.json_object, self.structural_tag is not None]
        if sum(given) != 1:
            raise ValueError(
                "structured outputs take exactly one of json, regex, choice, grammar, json_object, "
                "structural_tag"
            )
        if self.choice is not None and not self.choice:
            raise ValueError("structured outputs choice needs at least one string")


@dataclass
class SamplingParams:
    """Per-request sampling; defaults follow vLLM (temperature 1.0, max_tokens 16).

    ``n`` is read by the offline ``LLM`` (n sequences per prompt, consecutive seeds); the server fans out
    its own ``n``, and the engine runs one sequence per request."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; n >= 0: chosen token plus the top n
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    prompt_logprobs: int | None = None  # None: off; n >= 0: each prompt token's logprob plus the top n
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.output_kind = RequestOutputKind(self.output_kind)  # an int too; ValueError if no kind
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self) -> None:
        checks = [
            (self.n >= 1, "n must be >= 1"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k >= -1, "top_k must be -1, 0 (off) or positive"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens must be >= 1"),
            (self.min_tokens >= 0, "min_tokens must be >= 0"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                "min_tokens must be <= max_tokens",
            ),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be in [0, 20]"),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
                "prompt_logprobs must be in [0, 20]",
            ),
            (
                all(-100 <= b <= 100 for b in (self.logit_bias or {}).values()),
                "logit_bias values must be in [-100, 100]",
            ),
            (all(s for s in self.stop), "stop strings must not be empty"),
            (self.seed is None or -(2**63) <= self.seed < 2**64, "seed must fit in 64 bits"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


# One entry per generated token: token id -> Logprob (the chosen token and the top n).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    new_logprobs: SampleLogprobs | None = None  # the new tokens' entries (with logprobs requested)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_output_tokens: int = 0  # tokens generated so far, whatever the output kind
    kv_transfer: KvHandoff | None = None  # prefill worker: where this request's blocks wait
    kv_handoff_seconds: float | None = None  # decode worker: how long pulling its blocks took


class OutputTokens(list[int]):
    """A request's output token ids (a plain list to callers) that also keep ``prompt + output``.

    Appending (and cutting a tail, as a rollback does) costs the same on both lists; any other change
    rewrites the combined list's output part. The prompt must not change in place.
    """

    def __init__(self, prompt: list[int], output: Iterable[int] = ()) -> None:
        super().__init__(output)
        self.prompt = prompt
        self.all_token_ids = [*prompt, *self]

    def append(self, token: int) -> None:
        super().append(token)
        self.all_token_ids.append(token)

    def extend(self, tokens: Iterable[int]) -> None:
        n = len(self)
        super().extend(tokens)
        self.all_token_ids += self[n:]

    def __iadd__(self, tokens: Iterable[int]) -> Self:  # type: ignore[override,misc]
        self.extend(tokens)
        return self

    def pop(self, index: SupportsIndex = -1, /) -> int:
        tail = operator.index(index) in (-1, len(self) - 1)
        token = super().pop(index)
        self._after_cut(tail)
        return token

    def __delitem__(self, key: SupportsIndex | slice, /) -> None:
        tail = _tail(key, len(self)) if isinstance(key, slice) else operator.index(key) in (-1, len(self) - 1)
        super().__delitem__(key)
        self._after_cut(tail)

    def __reduce__(self) -> tuple[type[list[int]], tuple[list[int]]]:
        return list, (list(self),)  # pickles and copies as a plain list (re-wrapped on use)

    def _after_cut(self, tail: bool) -> None:
        if tail:
            del self.all_token_ids[len(self.prompt) + len(self) :]
        else:
            self._sync()

    def _sync(self) -> None:
        del self.all_token_ids[len(self.prompt) :]
        self.all_token_ids += self


def _tail(key: slice, n: int) -> bool:
    """Whether deleting ``key`` from a list of ``n`` items leaves a prefix of it."""
    _, stop, step = key.indices(n)
    return step == 1 and stop == n


def _synced(name: str) -> Callable[..., Any]:
    method = getattr(list, name)

    def wrapper(self: OutputTokens, *args: Any, **kwargs: Any) -> Any:
        result = method(self, *args, **kwargs)
        self._sync()
        return result

    wrapper.__name__ = name
    return wrapper


for _name in ("insert", "remove", "clear", "sort", "reverse", "__setitem__", "__imul__"):
    setattr(OutputTokens, _name, _synced(_name))


@dataclass
class RemotePrefill:
    """What a decode worker gets from the prefill worker that ran a request's prompt."""

    first_token: int
    first_logprobs: dict[int, Logprob] | None = None
    num_cached_tokens: int = 0
    handoff: KvHandoff | None = None  # None: the first token finished the request, nothing to pull
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    max_tokens: int = 0  # set on admission: params.max_tokens, or what the context leaves
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    remote_decode: bool = False  # prefill worker: hand the blocks off after the first token
    remote_prefill: RemotePrefill | None = None  # decode worker: the prompt ran elsewhere
    kv_handoff_seconds: float | None = None  # decode worker: its blocks' pull took this; reported once
    # Speculative decoding: tokens drafted for the next positions (not yet verified) and, for requests
    # that sample at random, the distribution [len(spec_token_ids), V] each draft was drawn from.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_probs: torch.Tensor | None = None
    prompt_logprobs: list[dict[int, Logprob]] = field(default_factory=list)  # position p: token p + 1

    def __post_init__(self) -> None:
        self.output_token_ids = OutputTokens(self.prompt_token_ids, self.output_token_ids)
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output tokens: one list kept in step with ``output_token_ids``, never copied.

        Read-only for callers; it grows with the output (slice it for a snapshot).
        """
        out = self.output_token_ids
        if not isinstance(out, OutputTokens) or out.prompt is not self.prompt_token_ids:
            out = self.output_token_ids = OutputTokens(self.prompt_token_ids, out)
        return out.all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def drop_drafts(self) -> None:
        self.spec_token_ids = []
        self.spec_probs = None

    def finish(self, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        self.drop_drafts()
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
