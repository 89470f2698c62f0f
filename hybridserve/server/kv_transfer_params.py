"""``kv_transfer_params`` on the OpenAI endpoints (vLLM's field): how a router drives the two workers.

Prefill worker: a request with ``{"do_remote_decode": true}`` runs its prompt, samples the first token
and answers (non-streaming) with one entry per choice: the first token and where its blocks wait.
Decode worker: the same request body with that answer as ``kv_transfer_params`` pulls the blocks and
generates the rest, streaming or not, exactly as a co-located server would. It reports how long each
choice's pull took (seconds, every cache group together: they move as one buffer): as
``kv_transfer_params`` in a JSON answer, as an SSE comment line just before ``[DONE]`` in a stream
(clients skip comments; the router reads it and drops it).
"""

from __future__ import annotations

import base64
import json
from dataclasses import asdict
from typing import Any

from hybridserve.engine.request import FinishReason, Logprob, RemotePrefill, Request, RequestOutput
from hybridserve.kv_transfer.records import KvHandoff
from hybridserve.server.errors import APIError

PARAM = "kv_transfer_params"
COMMENT = f": {PARAM} "  # the stream's form: this prefix, the JSON object, one line


def apply_kv_transfer(requests: list[Request], params: dict[str, Any] | None, stream: bool) -> None:
    """Mark ``requests`` (in fan-out order) for a handoff as ``params`` asks; 400 on a malformed one."""
    if not params:
        return
    if params.get("do_remote_decode"):
        if stream:
            raise APIError(400, "do_remote_decode answers with the handoff: send stream=false", param=PARAM)
        for r in requests:
            r.remote_decode = True
        return
    entries = params.get("requests")
    if not isinstance(entries, list) or len(entries) != len(requests):
        raise APIError(
            400,
            f"kv_transfer_params.requests must hold one entry per choice ({len(requests)}), as the prefill "
            f"worker answered this same request",
            param=PARAM,
        )
    for r, entry in zip(requests, entries, strict=True):
        r.remote_prefill = _remote_prefill(entry, r)


def _remote_prefill(entry: Any, r: Request) -> RemotePrefill:
    try:
        handoff = entry.get("handoff")
        remote = RemotePrefill(
            first_token=int(entry["first_token"]),
            first_logprobs=_logprobs_from_json(entry.get("first_logprobs")),
            num_cached_tokens=int(entry.get("num_cached_tokens", 0)),
            handoff=_handoff_from_json(handoff) if handoff else None,
            finish_reason=FinishReason(entry["finish_reason"]) if entry.get("finish_reason") else None,
            stop_reason=entry.get("stop_reason"),
        )
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise APIError(400, f"malformed kv_transfer_params entry: {exc!r}", param=PARAM) from exc
    n = len(r.prompt_token_ids)
    if remote.handoff is not None and remote.handoff.num_tokens != n:
        raise APIError(
            400,
            f"the prefill worker ran a prompt of {remote.handoff.num_tokens} tokens, this worker reads "
            f"{n}: both must serve the same model and tokenizer, and get the same request body",
            param=PARAM,
        )
    return remote


def prefill_answer(finals: list[RequestOutput]) -> dict[str, Any]:
    """The prefill worker's ``kv_transfer_params``: one entry per engine request, in fan-out order."""
    return {"requests": [_entry(o) for o in finals]}


def _entry(out: RequestOutput) -> dict[str, Any]:
    c = out.outputs[0]
    handed_off = out.kv_transfer is not None and c.finish_reason == FinishReason.LENGTH.value
    entry: dict[str, Any] = {
        "first_token": c.token_ids[0] if c.token_ids else None,
        "first_logprobs": _logprobs_to_json(c.logprobs[0]) if c.logprobs else None,
        "num_cached_tokens": out.num_cached_tokens,
        "handoff": _handoff_to_json(out.kv_transfer) if handed_off and out.kv_transfer else None,
        "finish_reason": None if handed_off else c.finish_reason,
        "stop_reason": None if handed_off else c.stop_reason,
    }
    return entry


def decode_answer(finals: list[RequestOutput]) -> dict[str, Any] | None:
    """The decode worker's ``kv_transfer_params``: the pull time of each choice that pulled blocks."""
    seconds = [o.kv_handoff_seconds for o in finals if o.kv_handoff_seconds is not None]
    return {"handoff_seconds": seconds} if seconds else None


def decode_comment(finals: list[RequestOutput]) -> str:
    """``decode_answer`` as an SSE comment event (empty when no choice pulled blocks)."""
    answer = decode_answer(finals)
    return f"{COMMENT}{json.dumps(answer)}\n\n" if answer else ""


def handoff_seconds(params: dict[str, Any]) -> list[float]:
    """The pull times in a decode worker's answer (an empty list if it has none or is malformed)."""
    seconds = params.get("handoff_seconds")
    if not isinstance(seconds, list):
        return []
    return [float(s) for s in seconds if isinstance(s, int | float)]


def handoff_bytes(params: dict[str, Any]) -> dict[str, int]:
    """Bytes a prefill worker's answer will move, per cache group (summed over its choices)."""
    out: dict[str, int] = {}
    for entry in params.get("requests") or []:
        handoff = entry.get("handoff") if isinstance(entry, dict) else None  # None: it ended on prefill
        moved = handoff.get("bytes_by_group", {}) if isinstance(handoff, dict) else {}
        for group, n in moved.items() if isinstance(moved, dict) else ():
            out[group] = out.get(group, 0) + int(n)
    return out


def handles(params: dict[str, Any]) -> list[str]:
    """The prefill worker's handles in an answer (to release them when no decode worker will pull)."""
    entries = params.get("requests") or []
    return [e["handoff"]["handle"] for e in entries if isinstance(e, dict) and e.get("handoff")]


def _handoff_to_json(h: KvHandoff) -> dict[str, Any]:
    data = asdict(h)
    if h.generator_state is not None:
        data["generator_state"] = base64.b64encode(h.generator_state).decode()
    return data


def _handoff_from_json(data: dict[str, Any]) -> KvHandoff:
    state = data.get("generator_state")
    return KvHandoff(
        handle=str(data["handle"]),
        control=str(data["control"]),
        store=str(data["store"]),
        num_tokens=int(data["num_tokens"]),
        plan=str(data.get("plan", "")),
        bytes_by_group={str(g): int(n) for g, n in (data.get("bytes_by_group") or {}).items()},
        seed=data.get("seed"),
        offset=int(data.get("offset", 0)),
        generator_state=base64.b64decode(state) if state else None,
    )


def _logprobs_to_json(entry: dict[int, Logprob]) -> list[list[float]]:
    return [[t, lp.logprob, lp.rank] for t, lp in entry.items()]


def _logprobs_from_json(data: Any) -> dict[int, Logprob] | None:
    if data is None:
        return None
    return {int(t): Logprob(float(lp), int(rank)) for t, lp, rank in data}
