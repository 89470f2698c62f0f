"""Tokenizer, chat template and incremental detokenisation (safe across multi-byte characters)."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from hybridserve.chat_format import deepseek_v4
from hybridserve.chat_format.modes import ENCODER_FILE, resolve_mode

# DeepSeek's tool-call markers (DeepSeek-V3.1 format: name, then JSON arguments).
TOOL_CALLS_BEGIN, TOOL_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"

# tokenizers' decode holds the GIL (~0.15 s for 1M ids); its decode_batch does not, but costs more to start.
_GIL_HELD_IDS = 4096


def _text(text: str) -> str:
    """Template text as a Jinja expression, so trim_blocks never eats its newlines."""
    return "{{ " + json.dumps(text, ensure_ascii=False) + " }}"


_TOOLS_PROMPT = (
    _text("\n\n## Tools\nYou have access to the following tools:\n") + "{%- for tool in tools %}"
    "{{ '\n### ' + tool['function']['name'] + '\nDescription: ' + (tool['function']['description'] or '') }}"
    "{{ '\n\nParameters: ' + (tool['function']['parameters'] or {}) | tojson + '\n' }}"
    "{%- endfor %}"
    + _text(
        "\nIMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
        f"{TOOL_CALLS_BEGIN}{TOOL_CALL_BEGIN}tool_call_name{TOOL_SEP}tool_call_arguments{TOOL_CALL_END}"
        "{{additional_tool_calls}}"
        f"{TOOL_CALLS_END}\n\nWhere:\n\n"
        "- `tool_call_name` must be an exact match to one of the available tools\n"
        "- `tool_call_arguments` must be valid JSON based on the tool's parameters schema\n"
        "- For multiple tool calls, chain them directly without separators or spaces\n"
    )
)

# DeepSeek-V4 checkpoints that ship no Jinja template get this (the DeepSeek chat format, with tools).
DEEPSEEK_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for m in messages if m['role'] == 'system' %}{{ m['content'] }}{% endfor %}"
    "{%- if tools %}" + _TOOLS_PROMPT + "{% endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{%- elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}"
    "{%- if m['tool_calls'] %}"
    + TOOL_CALLS_BEGIN
    + "{% for call in m['tool_calls'] %}"
    + TOOL_CALL_BEGIN
    + "{{ call['function']['name'] }}"
    + TOOL_SEP
    + "{{ call['function']['arguments'] if call['function']['arguments'] is string "
    "else call['function']['arguments'] | tojson }}"
    + TOOL_CALL_END
    + "{% endfor %}"
    + TOOL_CALLS_END
    + "{% endif %}"
    "<｜end▁of▁sentence｜>"
    "{%- elif m['role'] == 'tool' %}<｜tool▁output▁begin｜>{{ m['content'] }}<｜tool▁output▁end｜>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """``tokenizer.json`` plus what we use of ``tokenizer_config.json`` and ``generation_config.json``."""

    def __init__(self, folder: str | Path, mode: str = "auto") -> None:
        folder = Path(folder)
        self.mode = resolve_mode(folder, mode)  # "hf": the Jinja chat template; "deepseek_v4": our encoder
        encoder = folder / ENCODER_FILE
        self.effort_prompts = deepseek_v4.effort_prompts(encoder.read_text() if encoder.is_file() else None)
        self.hf = HFTokenizer.from_file(str(folder / "tokenizer.json"))
        cfg = _read_json(folder / "tokenizer_config.json")
        gen = _read_json(folder / "generation_config.json")
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.add_bos = bool(cfg.get("add_bos_token", self.bos_token is not None))
        self.chat_template: str = cfg.get("chat_template") or DEEPSEEK_CHAT_TEMPLATE
        self.eos_token_ids = self._eos_ids(gen)
        self.bos_token_id = self.hf.token_to_id(self.bos_token) if self.bos_token else None
        self.vocab_size = self.hf.get_vocab_size(with_added_tokens=True)
        added = self.hf.get_added_tokens_decoder().items()
        self._specials = {t.content: (i, t) for i, t in added if t.special}  # text -> (id, AddedToken)
        by_length = sorted(self._specials, key=len, reverse=True)
        self._special_re = re.compile("(" + "|".join(map(re.escape, by_length)) + ")") if by_length else None
        # A private copy that splits special-token text like plain text; the shared one is never toggled.
        self._text_hf = HFTokenizer.from_str(self.hf.to_str())
        self._text_hf.encode_special_tokens = True
        longest = max((len(t.encode()) for t in self.hf.get_vocab(with_added_tokens=True)), default=1)
        # Without a normalizer no token covers more input bytes than its own text has (byte-level
        # tokens spell a byte with a 1-2 byte character); a normalizer could delete input, so no bound.
        self._max_bytes_per_token = longest if self.hf.normalizer is None else None
        self._token_texts: dict[int, str] = {}  # at most one entry per vocabulary token

    def _eos_ids(self, gen: dict[str, Any]) -> tuple[int, ...]:
        ids = gen.get("eos_token_id")
        if ids is None and self.eos_token is not None:
            ids = self.hf.token_to_id(self.eos_token)
        if ids is None:
            return ()
        return tuple(ids) if isinstance(ids, list) else (int(ids),)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = _encode(self.hf, text, add_special_tokens)
        if (
            add_special_tokens
            and self.add_bos
            and self.bos_token_id is not None
            and ids[:1] != [self.bos_token_id]
        ):
            ids = [self.bos_token_id, *ids]
        return ids

    def min_num_tokens(self, text: str) -> int:
        """A lower bound on ``len(encode(text))``, computed without encoding (0 when none is known).

        Lets the server refuse a prompt that cannot fit before spending seconds tokenising it.
        """
        if self._max_bytes_per_token is None:
            return 0
        return -(-len(text.encode()) // self._max_bytes_per_token)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if len(ids) > _GIL_HELD_IDS:  # decode_batch lets other threads (the event loop) run meanwhile
            return str(self.hf.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0])
        return str(self.hf.decode(ids, skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        """One token's text, remembered: logprobs name ~20 tokens per position, mostly the same ones."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.decode([token_id], skip_special_tokens=False)
        return text

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """``extra``: more template variables, e.g. ``tools`` (OpenAI tool definitions)."""
        return _compiled_template(self.chat_template).render(
            **extra,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> tuple[list[int], str]:
        """Token ids of the rendered conversation, with message content encoded as plain text: special-token
        strings inside content are not parsed as special tokens (as vLLM/transformers' split_special_tokens);
        -> (ids, rendered text).

        Content ``None`` renders as ``""`` and a list of text parts as their concatenation. For content free
        of special-token text the ids equal ``encode(apply_chat_template(...), add_special_tokens=False)``.
        Only content is protected, so special-token text in any other message field raises ValueError, as
        does special-token text in content when the template transforms content (so it can't be located).
        In ``deepseek_v4`` mode every text the client sent is protected, and ``extra`` holds ``tools`` and
        the options of ``chat_format.deepseek_v4.options_from``.
        """
        if self.mode == "deepseek_v4":
            options = deepseek_v4.options_from(extra, add_generation_prompt, self.effort_prompts)
            v4_pieces = deepseek_v4.render(messages, extra.get("tools"), options)
            return self.encode_pieces(v4_pieces), deepseek_v4.prompt_text(v4_pieces)
        msgs = [{**m, "content": _content_text(m.get("content"))} for m in messages]
        others = [{k: v for k, v in m.items() if k != "content"} for m in msgs]
        self._reject_specials(others, "message fields other than content")
        self._reject_specials(list(extra.values()), "tools or template arguments")
        text = self.apply_chat_template(msgs, add_generation_prompt, **extra)
        pieces = self._split_content(msgs, add_generation_prompt, text, extra)
        if extra.get("continue_final_message"):
            pieces = _through_last_content(pieces)
            text = "".join(p for p, _ in pieces)
        if pieces is None:
            self._reject_specials([m["content"] for m in msgs], "message content with this chat template")
            return self.encode(text, add_special_tokens=False), text
        return self.encode_pieces(pieces), text

    def _reject_specials(self, values: list[Any], where: str) -> None:
        found = sorted({t for s in _strings(values) for t in self._specials if t in s})
        if found:
            raise ValueError(f"special-token text {', '.join(map(repr, found))} is not allowed in {where}")

    def _split_content(
        self, msgs: list[dict[str, Any]], add_generation_prompt: bool, text: str, extra: dict[str, Any]
    ) -> list[tuple[str, bool]] | None:
        """``text`` as (piece, is_content) pairs, found by rendering with a sentinel per message content;
        None when the template transforms content (the sentinel render does not map back to ``text``)."""
        used = set(self.chat_template).union(*_strings([msgs, extra, self.bos_token, self.eos_token]))
        mark = next((chr(c) for c in range(0xE000, 0xF900) if chr(c) not in used), None)  # private use area
        if mark is None:
            return None
        marked = [{**m, "content": f"{mark}{i}{mark}"} for i, m in enumerate(msgs)]
        try:
            marked_text = self.apply_chat_template(marked, add_generation_prompt, **extra)
            parts = re.split(f"{mark}([0-9]+){mark}", marked_text)
        except Exception:  # the template may fail on the sentinel where it accepted the real content
            return None
        pieces = [(p, False) if k % 2 == 0 else (_index(msgs, p), True) for k, p in enumerate(parts)]
        bad = any(p is None or (not is_content and mark in p) for p, is_content in pieces)
        if bad or "".join(p or "" for p, _ in pieces) != text:
            return None
        return [(p or "", is_content) for p, is_content in pieces]

    def encode_pieces(self, pieces: list[tuple[str, bool]]) -> list[int]:
        """(text, is_content) pieces: special tokens of non-content pieces as ids, the text between them
        (content too) as plain text."""
        runs, specials = self._runs(pieces)
        ids: list[int] = []
        for k, run in enumerate(runs):
            ids += _encode(self._text_hf, run, False) if run else []
            ids += [specials[k]] if k < len(specials) else []
        return ids

    def _runs(self, pieces: list[tuple[str, bool]]) -> tuple[list[str], list[int]]:
        """Texts between the special tokens of template pieces (one more than there are tokens), token ids."""
        runs, specials = [""], []
        for piece, is_content in pieces:
            parts = [piece] if is_content or self._special_re is None else self._special_re.split(piece)
            runs[-1] += parts[0]
            specials += [self._specials[t] for t in parts[1::2]]
            runs += parts[2::2]
        for k, (_, token) in enumerate(specials):  # whitespace the tokenizer strips around such tokens
            runs[k] = runs[k].rstrip(_WHITE_SPACE) if token.lstrip else runs[k]
            runs[k + 1] = runs[k + 1].lstrip(_WHITE_SPACE) if token.rstrip else runs[k + 1]
        return runs, [i for i, _ in specials]


# Unicode White_Space, what the tokenizers library strips around such tokens (its regex `\s`); Python's
# str.strip() also strips U+001C..U+001F, which it does not.
_WHITE_SPACE = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680"
    + "".join(map(chr, range(0x2000, 0x200B)))
    + "\u2028\u2029\u202f\u205f\u3000"
)


def _through_last_content(pieces: list[tuple[str, bool]] | None) -> list[tuple[str, bool]]:
    """The rendered conversation cut after the last message's content, so the model continues it."""
    last = max((k for k, (_, is_content) in enumerate(pieces or []) if is_content), default=None)
    if pieces is None or last is None:
        raise ValueError("continue_final_message: the final message cannot be found in this chat template")
    return pieces[: last + 1]


def _encode(hf: HFTokenizer, text: str, add_special_tokens: bool) -> list[int]:
    # encode_batch releases the GIL (encode does not), so a large prompt encoded in a worker thread
    # never stalls the event loop.
    return list(hf.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)


@functools.lru_cache(maxsize=16)
def _compiled_template(source: str) -> jinja2.Template:
    """A chat template compiled once, not per request: compiling took ~10 ms, a sixth of the API
    process's busy time in a burst of 64 chat requests (py-spy); rendering a compiled one is safe from
    any thread."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    env.filters["tojson"] = _tojson
    return env.from_string(source)


def _raise(message: str) -> None:
    raise ValueError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    """JSON as transformers' templates render it (not HTML-escaped, unlike Jinja's own filter)."""
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _content_text(content: Any) -> str:
    """Message content as one string: None is empty, a list of text parts is joined."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return "".join(map(_part_text, content))
    kind = type(content).__name__
    raise ValueError(f"message content must be a string or a list of text parts, not {kind}")


def _part_text(part: Any) -> str:
    if isinstance(part, str):
        return part
    if isinstance(part, dict) and isinstance(part.get("text"), str):
        return str(part["text"])
    raise ValueError("message content parts must be strings or text parts ({'type': 'text', 'text': ...})")


def _strings(value: Any) -> Iterator[str]:
    """Every string in a nest of dicts, lists and tuples."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _strings(v)


def _index(msgs: list[dict[str, Any]], digits: str) -> str | None:
    """The content of message number ``digits``, or None when there is no such message."""
    i = int(digits)
    return msgs[i]["content"] if i < len(msgs) and str(i) == digits else None


def _read_json(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text())) if path.is_file() else {}


def load_chat_template(value: str) -> str:
    """A chat template given as a file path or as the template text itself (vLLM's --chat-template)."""
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text()
    except OSError:  # a template too long to be a path
        pass
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"chat template {value!r} is neither a file nor a Jinja template")


def load_tokenizer(folder: str | Path, mode: str = "auto") -> Tokenizer | None:
    """The folder's tokenizer, or None when it ships none (token-id prompts only); ``mode`` as
    ``chat_format.modes.resolve_mode``."""
    return Tokenizer(folder, mode) if (Path(folder) / "tokenizer.json").is_file() else None


class IncrementalDetokenizer:
    """Turns generated token ids into text chunks; a chunk never ends inside a UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.stream = DecodeStream(ids=prompt_ids[-4:], skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        return self.stream.step(self.tokenizer.hf, token_id) or ""
