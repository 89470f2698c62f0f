"""DataParallelEngine: EngineCore's offline interface (add_request / step / finish_request) over N
engine-core ranks in their own processes, for ``LLM(..., data_parallel_size=N)``."""

from __future__ import annotations

import dataclasses

from hybridserve.config import EngineConfig
from hybridserve.engine.client.dp_client import DPEngineCoreClient
from hybridserve.engine.errors import EngineDeadError, RequestRejected
from hybridserve.engine.messages import AddRequest, EngineFailed, FinishRequests, Rejected, StepOutputs
from hybridserve.engine.outputs import EngineCoreOutput
from hybridserve.engine.request import FinishReason, Request


class DataParallelEngine:
    def __init__(self, config: EngineConfig, step_timeout_s: float = 300.0) -> None:
        """The ranks compile their steps before they answer: offline, no later call waits for a compile."""
        self.client = DPEngineCoreClient(dataclasses.replace(config, compile_in_background=False))
        self.limits = self.client.ready.limits
        self.step_timeout_s = step_timeout_s
        self.unfinished: set[str] = set()

    def add_request(self, request: Request) -> None:
        if request.request_id in self.unfinished:
            raise RequestRejected(f"request id {request.request_id!r} is already in use", param=None)
        self.limits.check(request.prompt_token_ids, request.params)
        self.client.send(
            AddRequest(request.request_id, request.prompt_token_ids, request.params, request.prompt)
        )
        self.unfinished.add(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.unfinished)

    def step(self) -> list[EngineCoreOutput]:
        """The outputs of the next rank step that has any; EngineDeadError when a rank is gone."""
        message = self.client.recv_blocking(self.step_timeout_s)
        if isinstance(message, EngineFailed):
            raise EngineDeadError(f"an engine-core rank failed: {message.message}")
        if isinstance(message, Rejected):
            self.unfinished.discard(message.request_id)
            return [EngineCoreOutput(message.request_id, [], None, FinishReason.ERROR, error=message.message)]
        if not isinstance(message, StepOutputs):
            return []
        for out in message.outputs:
            if out.finish_reason is not None:
                self.unfinished.discard(out.request_id)
        return message.outputs

    def finish_request(
        self, request_id: str, reason: FinishReason, stop_reason: int | str | None = None
    ) -> bool:
        if request_id not in self.unfinished:
            return False
        self.client.send(FinishRequests([request_id], reason, stop_reason))
        self.unfinished.discard(request_id)
        return True

    def abort_request(self, request_id: str) -> bool:
        return self.finish_request(request_id, FinishReason.ABORT)

    def close(self) -> None:
        self.client.close()
