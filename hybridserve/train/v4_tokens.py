"""Extend a trained byte-level BPE tokenizer to DeepSeek-V4's conversation format.

Two kinds of new tokens, appended after the existing ids (which keep their meaning):

* **BPE words** of the DSML syntax (``invoke``, ``parameter``, ``="``, ...): ordinary vocabulary entries
  with merges appended after the trained ones, as a larger vocabulary would have them. Trained merges
  rank first, so text changes only where a new merge joins two tokens the old model left apart.
* **Added tokens** that DeepSeek-V4's own tokenizer has as single tokens and our encoder writes:
  ``<think>``, ``</think>``, ``｜DSML｜`` and ``<｜latest_reminder｜>``. Like DeepSeek's, they are not
  *special*: decoding keeps them, so the reasoning and DSML parsers read them from the text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from tokenizers import AddedToken, Tokenizer

from hybridserve.chat_format.dsml import DSML, END_THINK, LATEST_REMINDER, THINK

# Single tokens of DeepSeek-V4's tokenizer that our encoder writes (its task tokens are not rendered).
V4_TOKENS = (THINK, END_THINK, DSML, LATEST_REMINDER)
# Words of DSML text that a pre-tokenizer piece spells whole (GPT-2 regex pieces).
DSML_WORDS = ("invoke", "parameter", "tool", "calls", '="', '">', "true", "false", "</", " string")


@dataclass(frozen=True)
class NewToken:
    """A token appended to the vocabulary and the old tokens it was built from (empty: added token)."""

    token_id: int
    text: str
    parts: tuple[int, ...]


def extend_tokenizer(tok: Tokenizer) -> tuple[Tokenizer, list[NewToken]]:
    """A copy of ``tok`` with the DSML words as BPE tokens and the V4 tokens added; the new tokens."""
    state = json.loads(tok.to_str())
    model = state["model"]
    vocab: dict[str, int] = model["vocab"]
    merges: list[list[str] | str] = model["merges"]
    new: list[NewToken] = []
    for word in DSML_WORDS:
        pieces = tok.encode(word, add_special_tokens=False).tokens
        left = pieces[0]
        for piece in pieces[1:]:
            joined = left + piece
            if joined not in vocab:
                parts = (vocab[left], vocab[piece])
                vocab[joined] = len(vocab)
                merges.append([left, piece] if merges and isinstance(merges[0], list) else f"{left} {piece}")
                new.append(NewToken(vocab[joined], joined, parts))
            left = joined
    extended = Tokenizer.from_str(json.dumps(state))
    missing = [t for t in V4_TOKENS if extended.token_to_id(t) is None]
    extended.add_tokens([AddedToken(t, special=False, normalized=False) for t in missing])
    new += [NewToken(_id(extended, t), t, ()) for t in missing]
    return extended, new


def _id(tok: Tokenizer, text: str) -> int:
    token_id = tok.token_to_id(text)
    if token_id is None:
        raise ValueError(f"{text!r} is not in the vocabulary")
    return int(token_id)
