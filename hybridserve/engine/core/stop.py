"""StopChecker: whether a request's newest token ends it, and why (vLLM's check_stop)."""

from __future__ import annotations

from dataclasses import dataclass

from hybridserve.engine.request import FinishReason, Request
from hybridserve.engine.sample.structured_outputs import StructuredOutputs


@dataclass
class StopChecker:
    structured: StructuredOutputs | None
    max_request_tokens: int  # prompt + output, the most a request may hold

    def check(self, req: Request, token: int) -> tuple[FinishReason | None, int | str | None]:
        """(reason, stop reason) once ``token``, just appended, ends ``req``; (None, None) otherwise."""
        p = req.params
        n_out = len(req.output_token_ids)
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in req.eos_token_ids:
                return FinishReason.STOP, None
            if token in p.stop_token_ids:
                return FinishReason.STOP, token
        if p.structured_outputs is not None and self.structured and self.structured.is_terminated(req):
            return FinishReason.STOP, None  # the grammar is complete (its stop token was ignore_eos'd)
        if n_out >= req.max_tokens or req.num_tokens >= self.max_request_tokens:
            return FinishReason.LENGTH, None
        return None, None
