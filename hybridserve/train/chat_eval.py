"""How well a checkpoint speaks DeepSeek-V4's format: greedy replies to fresh synthetic requests, read by
the server's own parsers (``--tool-call-parser deepseek_v4``, ``--reasoning-parser deepseek_v4``).

    python -m hybridserve.train.chat_eval CHECKPOINT [--n 40] [--seed 99]

Per request kind and mode: how often the reply parses as the expected call (right name, JSON arguments
equal to the request's), how many tokens the call took, and in thinking mode how often ``</think>`` came.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hybridserve import LLM, SamplingParams
from hybridserve.chat_format.dsml import END_THINK, THINK
from hybridserve.server.dsml_tool_calls import parse_dsml
from hybridserve.server.reasoning import split_reasoning
from hybridserve.train.chat_tools import TOOLS, Tool, ToolUse

SYSTEM = "You are a helpful assistant."


@dataclass
class CallScore:
    thinking: bool
    requests: int = 0
    parsed: int = 0  # a tool call with JSON arguments came out
    exact: int = 0  # the expected name and arguments
    closed: int = 0  # thinking mode: </think> came
    call_tokens: int = 0  # tokens after ``</think>`` (EOS included) of the replies that parsed
    reply_tokens: int = 0

    def add(self, text: str, answer_ids: list[int], n_tokens: int, tool: Tool, use: ToolUse) -> None:
        """Score one reply (``answer_ids``: its tokens after ``</think>``)."""
        _, content = split_reasoning(THINK if self.thinking else END_THINK, text)
        _, calls = parse_dsml(content or "")
        self.requests += 1
        self.reply_tokens += n_tokens
        self.closed += int(self.thinking and content is not None)
        args = _json_args(calls[0].function.arguments) if calls else None
        if args is not None:
            self.parsed += 1
            self.call_tokens += len(answer_ids)
            self.exact += int(calls[0].function.name == tool.name and args == use.arguments)


def tool_request(rng: random.Random) -> tuple[list[dict[str, Any]], list[Tool], Tool, ToolUse]:
    tools = rng.sample(TOOLS, rng.choice((1, 2, 3)))
    tool = rng.choice(tools)
    use = tool.draw(rng)
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": use.request}], tools, tool, use


def score_calls(
    llm: LLM, n: int, seed: int, thinking: bool, show: int = 0, max_tokens: int = 160
) -> CallScore:
    rng = random.Random(seed)
    score = CallScore(thinking)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    for _ in range(n):
        messages, tools, tool, use = tool_request(rng)
        defs, kwargs = [t.definition() for t in tools], {"thinking": thinking}
        reply = llm.chat(messages, params, tools=defs, chat_template_kwargs=kwargs)[0].outputs[0]
        if score.requests < show:
            print(json.dumps({"request": use.request, "reply": reply.text}, ensure_ascii=False), flush=True)
        score.add(reply.text, _answer_ids(llm, list(reply.token_ids)), len(reply.token_ids), tool, use)
    return score


def _answer_ids(llm: LLM, ids: list[int]) -> list[int]:
    """The reply's tokens after its ``</think>`` token (all of them if there is none)."""
    assert llm.tokenizer is not None
    end = llm.tokenizer.encode(END_THINK, False)
    return ids[ids.index(end[0]) + 1 :] if len(end) == 1 and end[0] in ids else ids


def _json_args(text: str | None) -> dict[str, Any] | None:
    try:
        value = json.loads(text or "")
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--n", type=int, default=40, help="requests per mode")
    ap.add_argument("--seed", type=int, default=99)
    ap.add_argument("--show", type=int, default=0, help="print the first N replies per mode")
    args = ap.parse_args(argv)
    # Eager: a few dozen short replies, where compiling the steps would take longer than running them.
    llm = LLM(str(args.checkpoint), tokenizer_mode="deepseek_v4", max_num_seqs=1, enforce_eager=True)
    for thinking in (False, True):
        print(json.dumps(asdict(score_calls(llm, args.n, args.seed, thinking, args.show))), flush=True)


if __name__ == "__main__":
    main()
