"""Byte-level BPE tokenizer with DeepSeek-style special tokens and chat template."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SPECIAL_TOKENS = (BOS, EOS, PAD, USER, ASSISTANT)  # ids 0..4, in this order

# DeepSeek-V3 style: bos, system prompt, then User/Assistant turns; assistant turns end with eos.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '<｜Assistant｜>' + message['content'] + eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)


@dataclass(frozen=True)
class SpecialIds:
    bos: int
    eos: int
    pad: int


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE; encoding adds bos (like DeepSeek's ``add_bos_token``), no eos."""
    tok = Tokenizer(models.BPE())
    # No normalizer: byte-level BPE must round-trip the exact input bytes.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def special_ids(tok: Tokenizer) -> SpecialIds:
    ids = [tok.token_to_id(t) for t in (BOS, EOS, PAD)]
    if None in ids:
        raise ValueError("tokenizer lacks the DeepSeek special tokens")
    bos, eos, pad = (int(i) for i in ids if i is not None)
    return SpecialIds(bos, eos, pad)


def tokenizer_config(model_max_length: int) -> dict[str, object]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer(tok: Tokenizer, folder: Path, model_max_length: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = tokenizer_config(model_max_length)
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    special_map = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    (folder / "special_tokens_map.json").write_text(
        json.dumps(special_map, indent=2, ensure_ascii=False) + "\n"
    )
