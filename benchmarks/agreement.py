"""Greedy token agreement of an OpenAI-compatible engine against the transformers reference.

For each of ``--num-prompts`` deterministic prompts (word windows at fixed offsets of the bundled
model's held-out text ``hybridserve/assets/austen-v4/heldout.txt``, or of built-in sentences when it is
missing) the engine is asked for a greedy completion (temperature 0, ``max_tokens``, ``ignore_eos``
unless ``--no-ignore-eos``). The reference runs transformers ``DeepseekV4ForCausalLM`` on exactly the
same prompt token ids, ONE SEQUENCE AT A TIME, with a manual greedy loop over its ``DynamicCache``
(prefill, then one token per step, argmax, no stopping criteria).

Which prompt ids the engine used: engines differ in how they tokenise (mlx-vlm adds a BOS in front of
a chat template that already starts with one). The candidates are, for ``completions``, the text with
and without the tokenizer's BOS, and for ``chat``, the checkpoint's chat template rendered as text
and encoded without special tokens (hybridserve, transformers) or with them (a second BOS). The
candidate whose length equals the engine's ``usage.prompt_tokens`` is used; ``prompt_ids_matched``
says whether one did (if not, the first candidate is used).

How tokens are compared (the engines return text, not ids): the reference ids are decoded one
prefix at a time (``skip_special_tokens``); ``agreed_tokens`` is the largest k such that the decoded
text of the first k reference tokens is a prefix of the engine's text. This is robust to
re-tokenisation (re-encoding generated text need not give back the generated ids) and to UTF-8
characters split across tokens (a prefix ending inside a character decodes to U+FFFD and simply does
not count until the character is complete; at the very end of the engine's text, where engines hold
back an incomplete character, the final tokens count when the text ends right before it). Tokens
that decode to nothing (EOS) count when the text after them still agrees. When the engine stopped
(``finish_reason`` "stop") right where the reference emits an EOS token, the prompt counts as fully
agreed (``eos_stop``). mlx-vlm's server drops the leading space of the first generated token
from its text; when the engine's text starts without whitespace and the reference's with, the
reference's leading whitespace is dropped too (``leading_space_dropped_by_engine``). Per prompt the
fraction is ``agreed_tokens / max_tokens``; the report gives the mean, the number of prompts in full
agreement and the first divergence position of each prompt, as JSON.

    python benchmarks/agreement.py --base-url http://127.0.0.1:8000 --model NAME \\
        --checkpoint data/bench-random-v4 --endpoint completions --num-prompts 8 --max-tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import torch

ROOT = Path(__file__).resolve().parent.parent
HELDOUT = ROOT / "hybridserve" / "assets" / "austen-v4" / "heldout.txt"
FALLBACK_SENTENCES = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must "
    "be in want of a wife. The morning was fine and the road to the village lay white and dry between "
    "the hedges. She had been told that the house was let at last, and she could talk of nothing else "
    "for the rest of the evening. In the beginning God created the heaven and the earth, and the earth "
    "was without form, and void. The committee met on Tuesday to consider the report on the new school "
    "building, and the vote was delayed until the budget could be reviewed by the city council."
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000 (with or without /v1)")
    p.add_argument("--model", required=True, help="model id to send in requests")
    p.add_argument("--checkpoint", required=True, type=Path, help="transformers checkpoint (reference)")
    p.add_argument("--endpoint", choices=["chat", "completions"], default="completions")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-words", type=int, default=40, help="words per prompt")
    p.add_argument("--text", type=Path, default=None, help="prompt source text (default: held-out text)")
    p.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send ignore_eos: true (transformers serve refuses the field: --no-ignore-eos)",
    )
    p.add_argument(
        "--extra-body",
        default=None,
        help="JSON object merged into each request body (see --help of transformers_server.py)",
    )
    p.add_argument("--stream", action="store_true", help="use SSE streaming and join the deltas")
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight at once")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dtype", default="auto", help="reference dtype: auto (the checkpoint's), float32, ...")
    p.add_argument("--threads", type=int, default=0, help="torch threads for the reference (0: default)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON report here too")
    p.add_argument("--show-text", action="store_true", help="include both texts per prompt in the report")
    return p.parse_args(argv)


def build_prompts(n: int, words_per_prompt: int, source: Path | None) -> list[str]:
    """n deterministic prompts: word windows at evenly spaced offsets of the source text."""
    path = source or (HELDOUT if HELDOUT.is_file() else None)
    text = path.read_text(encoding="utf-8") if path is not None else FALLBACK_SENTENCES
    words = text.split()
    while len(words) < words_per_prompt * 2:
        words = words + words
    span = len(words) - words_per_prompt
    return [" ".join(words[(i * span) // max(n, 1) :][:words_per_prompt]) for i in range(n)]


# --------------------------------------------------------------------------- engine requests


def request_body(args: argparse.Namespace, prompt: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": args.model, "max_tokens": args.max_tokens, "temperature": 0.0}
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    if args.extra_body:
        body.update(json.loads(args.extra_body))
    return body


async def ask(client: httpx.AsyncClient, url: str, body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The engine's text, finish_reason and usage for one request."""
    t0 = time.perf_counter()
    if not body.get("stream"):
        r = await client.post(url, json=body)
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:500]}")
        data = r.json()
        choice = data["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        return {
            "text": text or "",
            "finish_reason": choice.get("finish_reason"),
            "usage": data.get("usage"),
            "seconds": time.perf_counter() - t0,
        }
    parts: list[str] = []
    finish, usage = None, None
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            event = json.loads(payload)
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices") or []:
                delta = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                parts.append(delta or "")
                finish = choice.get("finish_reason") or finish
    seconds = time.perf_counter() - t0
    return {"text": "".join(parts), "finish_reason": finish, "usage": usage, "seconds": seconds}


async def ask_all(args: argparse.Namespace, prompts: list[str]) -> list[dict[str, Any]]:
    base = args.base_url.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    chat = args.endpoint == "chat"
    url = base + ("/chat/completions" if chat else "/completions")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    sem = asyncio.Semaphore(max(1, args.concurrency))
    async with httpx.AsyncClient(timeout=args.timeout, headers=headers) as client:

        async def one(prompt: str) -> dict[str, Any]:
            async with sem:
                return await ask(client, url, request_body(args, prompt), chat)

        return list(await asyncio.gather(*(one(p) for p in prompts)))


# --------------------------------------------------------------------------- reference


def candidate_prompt_ids(tokenizer: Any, prompt: str, chat: bool) -> list[list[int]]:
    if chat:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        first = list(tokenizer(rendered, add_special_tokens=False).input_ids)
        second = list(tokenizer(rendered).input_ids)
    else:
        first = list(tokenizer(prompt).input_ids)
        second = list(tokenizer(prompt, add_special_tokens=False).input_ids)
    return [first] if second == first else [first, second]


@torch.inference_mode()
def reference_greedy(model: Any, ids: list[int], max_tokens: int) -> list[int]:
    """Single sequence: prefill, then one token per step over a DynamicCache; argmax; never stops."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
    token = int(out.logits[0, -1].argmax())
    generated = [token]
    while len(generated) < max_tokens:
        out = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True)
        token = int(out.logits[0, -1].argmax())
        generated.append(token)
    return generated


def agreed_prefix(tokenizer: Any, ref_ids: list[int], engine_text: str) -> tuple[int, str, bool]:
    """Largest k with decode(ref_ids[:k]) a prefix of engine_text; the reference text; and whether the
    reference's leading whitespace was dropped (the engine's text starts without the space that the
    first generated token carries, as mlx-vlm's server does)."""
    full = tokenizer.decode(ref_ids, skip_special_tokens=True)
    strip = full[:1].isspace() and not engine_text[:1].isspace()
    agreed = 0
    for k in range(1, len(ref_ids) + 1):
        text = tokenizer.decode(ref_ids[:k], skip_special_tokens=True)
        text = text.lstrip() if strip else text
        if engine_text.startswith(text) or (text.endswith("\ufffd") and text.rstrip("\ufffd") == engine_text):
            agreed = k  # (engines hold back a final incomplete UTF-8 character: the text ends before it)
        elif not text.endswith("\ufffd"):
            break  # diverged for good (not just a UTF-8 character cut in half)
    return agreed, full, strip


def _text(tokenizer: Any, ids: list[int], strip: bool) -> str:
    text: str = tokenizer.decode(ids, skip_special_tokens=True)
    return text.lstrip() if strip else text


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer, DeepseekV4ForCausalLM

    if args.threads:
        torch.set_num_threads(args.threads)
    chat = args.endpoint == "chat"
    prompts = build_prompts(args.num_prompts, args.prompt_words, args.text)
    t0 = time.perf_counter()
    answers = asyncio.run(ask_all(args, prompts))
    engine_seconds = time.perf_counter() - t0

    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    dtype: Any = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    model = DeepseekV4ForCausalLM.from_pretrained(args.checkpoint, dtype=dtype).eval()
    eos = model.config.eos_token_id
    eos_ids = {eos} if isinstance(eos, int) else set(eos or [])

    rows: list[dict[str, Any]] = []
    t1 = time.perf_counter()
    for i, (prompt, answer) in enumerate(zip(prompts, answers, strict=True)):
        candidates = candidate_prompt_ids(tokenizer, prompt, chat)
        n_engine = (answer.get("usage") or {}).get("prompt_tokens")
        matching = [c for c in candidates if len(c) == n_engine]
        ids = matching[0] if matching else candidates[0]
        ref = reference_greedy(model, ids, args.max_tokens)
        agreed, ref_text, stripped = agreed_prefix(tokenizer, ref, answer["text"])
        eos_stop = (
            answer.get("finish_reason") == "stop"
            and agreed < len(ref)
            and ref[agreed] in eos_ids
            and _text(tokenizer, ref[:agreed], stripped) == answer["text"]
        )
        row: dict[str, Any] = {
            "prompt": i,
            "prompt_tokens": len(ids),
            "engine_prompt_tokens": n_engine,
            "prompt_ids_matched": bool(matching),
            "agreed_tokens": args.max_tokens if eos_stop else agreed,
            "first_divergence": None if eos_stop or agreed >= args.max_tokens else agreed,
            "eos_stop": eos_stop,
            "leading_space_dropped_by_engine": stripped,
            "engine_finish_reason": answer.get("finish_reason"),
            "engine_completion_tokens": (answer.get("usage") or {}).get("completion_tokens"),
            "engine_seconds": round(answer["seconds"], 3),
        }
        if args.show_text:
            row["engine_text"] = answer["text"]
            row["reference_text"] = ref_text
        rows.append(row)
        print(f"prompt {i}: {row['agreed_tokens']}/{args.max_tokens} tokens agree", file=sys.stderr)

    fractions = [min(r["agreed_tokens"], args.max_tokens) / args.max_tokens for r in rows]
    report = {
        "base_url": args.base_url,
        "model": args.model,
        "checkpoint": str(args.checkpoint),
        "endpoint": args.endpoint,
        "stream": args.stream,
        "concurrency": args.concurrency,
        "num_prompts": len(rows),
        "max_tokens": args.max_tokens,
        "reference": f"transformers DeepseekV4ForCausalLM, {str(model.dtype).removeprefix('torch.')}, "
        "batch 1, DynamicCache greedy",
        "mean_agreement": sum(fractions) / max(len(fractions), 1),
        "full_agreement_prompts": sum(f >= 1.0 for f in fractions),
        "mean_agreed_tokens": sum(r["agreed_tokens"] for r in rows) / max(len(rows), 1),
        "prompt_ids_matched": all(r["prompt_ids_matched"] for r in rows),
        "engine_seconds": round(engine_seconds, 2),
        "reference_seconds": round(time.perf_counter() - t1, 2),
        "prompts": rows,
    }
    text = json.dumps(report, indent=2, ensure_ascii=False)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
