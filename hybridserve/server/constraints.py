"""A request's output constraint from whichever field it came in: ``response_format``, vLLM's ``guided_*``
fields or its ``structured_outputs`` object; checked here so that a bad one is a 400 before it queues."""

from __future__ import annotations

from typing import Any

from hybridserve.engine.errors import RequestRejected
from hybridserve.engine.request import StructuredOutputsParams
from hybridserve.engine.sample.structured_outputs import check_spec
from hybridserve.server.errors import APIError
from hybridserve.server.protocol import _SamplingFields


def _given(body: _SamplingFields) -> list[tuple[str, dict[str, Any]]]:
    """(field, StructuredOutputsParams kwargs) of every constraint the request sets."""
    found: list[tuple[str, dict[str, Any]]] = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    if fmt is not None and fmt.type == "json_schema" and fmt.json_schema is not None:
        found.append(("response_format", {"json": fmt.json_schema.schema_}))
    guided = {"json": body.guided_json, "regex": body.guided_regex, "choice": body.guided_choice}
    guided["grammar"] = body.guided_grammar
    found += [(f"guided_{k}", {k: v}) for k, v in guided.items() if v is not None]
    so = body.structured_outputs
    if so is not None:
        fields: dict[str, Any] = {"json": so.json_, "regex": so.regex, "choice": so.choice}
        fields.update(grammar=so.grammar, json_object=so.json_object or None)
        found += [("structured_outputs", {k: v}) for k, v in fields.items() if v is not None]
    return found


def structured_outputs(body: _SamplingFields) -> StructuredOutputsParams | None:
    """The request's constraint (at most one), checked; 400 naming the field and the problem."""
    given = _given(body)
    if len(given) > 1:
        names = ", ".join(sorted({f for f, _ in given}))
        raise APIError(400, f"send at most one output constraint (got {names})", param=given[1][0])
    if not given:
        return None
    param, kwargs = given[0]
    return checked(StructuredOutputsParams(**kwargs), param)


def checked(spec: StructuredOutputsParams, param: str) -> StructuredOutputsParams:
    try:
        check_spec(spec)
    except RequestRejected as exc:
        raise APIError(400, str(exc), param=param, code=exc.code) from exc
    return spec
