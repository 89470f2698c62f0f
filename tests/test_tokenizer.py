from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from hybridserve.tokenizer import DEEPSEEK_CHAT_TEMPLATE, IncrementalDetokenizer, Tokenizer
from tests.tiny_models import SAMPLE_TEXT


def test_incremental_detokenisation_never_splits_a_character(tiny_checkpoint: Callable[[str], Path]) -> None:
    tok = Tokenizer(tiny_checkpoint("mixed"))
    text = "naïve café 🙂 中文字符 — «ok»"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.encode()) // 4  # byte-level pieces: multi-byte characters span tokens
    detok = IncrementalDetokenizer(tok, [1], skip_special_tokens=True)
    chunks = [detok.step(i) for i in ids]
    assert "".join(chunks) == text
    assert all("\ufffd" not in c for c in chunks)
    assert any(c == "" for c in chunks)  # a token that ends inside a character yields nothing yet


def test_encode_adds_bos_once_and_decode_round_trips(tiny_checkpoint: Callable[[str], Path]) -> None:
    tok = Tokenizer(tiny_checkpoint("mixed"))
    ids = tok.encode(SAMPLE_TEXT[:80])
    assert ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id
    assert tok.decode(ids) == SAMPLE_TEXT[:80]
    assert tok.eos_token_ids == (2,)


def test_builtin_deepseek_chat_format(tiny_checkpoint: Callable[[str], Path]) -> None:
    tok = Tokenizer(tiny_checkpoint("mixed"))
    assert tok.chat_template == DEEPSEEK_CHAT_TEMPLATE  # the tiny checkpoint ships no template
    text = tok.apply_chat_template(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Again"},
        ]
    )
    expected = "<bos>Be brief.<｜User｜>Hi<｜Assistant｜>Hello.<｜end▁of▁sentence｜>"
    assert text == expected + "<｜User｜>Again<｜Assistant｜>"
