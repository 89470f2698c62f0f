"""POST /v1/responses: OpenAI's Responses API over the chat machinery (one choice; nothing stored).

Output items: a ``reasoning`` item (with a reasoning parser), a ``message`` with ``output_text``, and a
``function_call`` per tool call. Streamed, each item is added, filled by deltas and done, in that order.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import Request as HTTPRequest

from hybridserve.engine.async_llm import AsyncLLM
from hybridserve.server.chat import output_reading, render_prompt, with_tool_constraint
from hybridserve.server.chat_prompt import v4_efforts
from hybridserve.server.responses_input import ResponsesRequest, to_chat
from hybridserve.server.responses_items import (
    call_item,
    finished,
    message_item,
    reasoning_item,
    response_shell,
)
from hybridserve.server.responses_stream import ResponseEvents
from hybridserve.server.serving import (
    ServerSettings,
    check_model,
    final_outputs,
    new_id,
    sampling_params,
    start,
)
from hybridserve.server.streams import guarded


async def create_response(
    body: ResponsesRequest, raw: HTTPRequest, llm: AsyncLLM, settings: ServerSettings
) -> Response:
    check_model(body, settings)
    chat = to_chat(body, v4_efforts(llm))
    ids, prompt = await render_prompt(chat, llm, settings)
    reading = output_reading(chat, llm, settings, prompt)
    params = with_tool_constraint(chat, sampling_params(chat, settings, chat.max_tokens, None), reading)
    base = new_id("resp")
    _, outputs = await start(llm, settings, base, [ids], params, 1, [prompt], chat)
    start_state = response_shell(base, body)
    if body.stream:
        events = ResponseEvents(start_state, reading)
        return StreamingResponse(guarded(events.run(outputs, ids)), media_type="text/event-stream")
    finals = await final_outputs(raw, outputs, 1)
    if finals is None:
        return Response(status_code=499)  # the client went away; its request was aborted
    out = finals[0].outputs[0]
    reasoning, content, calls = reading.whole(out.text)
    items = [reasoning_item(new_id("rs"), reasoning)] if reasoning else []
    items += [message_item(new_id("msg"), content)] if content else []
    items += [call_item(new_id("fc"), c.id, c.function.name, c.function.arguments) for c in calls]
    return JSONResponse(finished(start_state, items, finals[0], ids, out.finish_reason))
