"""What the API process and the engine-core process say to each other over ZMQ (msgspec msgpack)."""

from __future__ import annotations

from typing import Any

import msgspec

from hybridserve.engine.limits import RequestLimits
from hybridserve.engine.outputs import EngineCoreOutput
from hybridserve.engine.request import FinishReason, RemotePrefill, SamplingParams
from hybridserve.engine.stats import EngineSnapshot


# ---- API process -> core -------------------------------------------------------------------------
class AddRequest(msgspec.Struct, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    remote_decode: bool = False
    remote_prefill: RemotePrefill | None = None


class FinishRequests(msgspec.Struct, tag="finish"):
    """Finish (abort, or stop on a stop string found in the text) requests and free their blocks."""

    request_ids: list[str]
    reason: FinishReason
    stop_reason: int | str | None = None


class UtilityCall(msgspec.Struct, tag="call"):
    call_id: int
    method: str  # an EngineCore method that takes no arguments, e.g. "reset_prefix_cache"


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class Wake(msgspec.Struct, tag="wake"):
    """Sent to every other data-parallel rank with each message to one rank, so that all ranks see the
    same number of messages and join the next step together (distributed/step_sync.py)."""


CoreInput = AddRequest | FinishRequests | UtilityCall | Shutdown | Wake


# ---- core -> API process -------------------------------------------------------------------------
class EngineReady(msgspec.Struct, tag="ready"):
    limits: RequestLimits
    device: str
    dtype: str
    cache_bytes: int
    num_cache_groups: int
    snapshot: EngineSnapshot


class StepOutputs(msgspec.Struct, tag="outputs"):
    outputs: list[EngineCoreOutput]
    snapshot: EngineSnapshot


class Rejected(msgspec.Struct, tag="rejected"):
    request_id: str
    message: str
    code: str
    param: str | None


class UtilityResult(msgspec.Struct, tag="result"):
    call_id: int
    error: str | None = None


class EngineFailed(msgspec.Struct, tag="failed"):
    """The core cannot go on (or could not start); it exits after sending this."""

    message: str


CoreOutput = EngineReady | StepOutputs | Rejected | UtilityResult | EngineFailed

_encoder = msgspec.msgpack.Encoder()
_input_decoder = msgspec.msgpack.Decoder(CoreInput)
_output_decoder = msgspec.msgpack.Decoder(CoreOutput)


def encode(message: Any) -> bytes:
    return _encoder.encode(message)


def decode_input(data: bytes) -> CoreInput:
    return _input_decoder.decode(data)


def decode_output(data: bytes) -> CoreOutput:
    return _output_decoder.decode(data)
