"""Tokenizer, chat template and incremental detokenisation (safe across multi-byte characters)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

# DeepSeek-V4 checkpoints that ship no Jinja template get this (the DeepSeek chat format).
DEEPSEEK_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for m in messages if m['role'] == 'system' %}{{ m['content'] }}{% endfor %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{%- elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """``tokenizer.json`` plus what we use of ``tokenizer_config.json`` and ``generation_config.json``."""

    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
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

    def _eos_ids(self, gen: dict[str, Any]) -> tuple[int, ...]:
        ids = gen.get("eos_token_id")
        if ids is None and self.eos_token is not None:
            ids = self.hf.token_to_id(self.eos_token)
        if ids is None:
            return ()
        return tuple(ids) if isinstance(ids, list) else (int(ids),)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self.hf.encode(text, add_special_tokens=add_special_tokens).ids
        if (
            add_special_tokens
            and self.add_bos
            and self.bos_token_id is not None
            and ids[:1] != [self.bos_token_id]
        ):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.hf.decode(ids, skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        template = env.from_string(self.chat_template)
        return template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


def _raise(message: str) -> None:
    raise ValueError(message)


def _read_json(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text())) if path.is_file() else {}


def load_tokenizer(folder: str | Path) -> Tokenizer | None:
    """The folder's tokenizer, or None when it ships none (token-id prompts only)."""
    return Tokenizer(folder) if (Path(folder) / "tokenizer.json").is_file() else None


class IncrementalDetokenizer:
    """Turns generated token ids into text chunks; a chunk never ends inside a UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.stream = DecodeStream(ids=prompt_ids[-4:], skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        return self.stream.step(self.tokenizer.hf, token_id) or ""
