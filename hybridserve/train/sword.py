"""Plain-text extraction from a SWORD ``zText`` Bible module with OSIS markup (ZIP compression).

A testament is three files: ``.bzs`` (per block: offset, compressed size, plain size as little-endian
uint32), ``.bzz`` (the zlib blocks) and ``.bzv`` (verse index, unused here: BlockType=BOOK means
one block per book, which is the unit we want).
"""

from __future__ import annotations

import html
import re
import struct
import zlib
from pathlib import Path

_NOTE = re.compile(r"<note\b[^>]*>.*?</note>", re.DOTALL)
_TITLE = re.compile(r"<title\b[^>]*>.*?</title>", re.DOTALL)
_BOOK_TITLE = re.compile(r'<milestone n="([^"]+)" type="x-usfm-toc1"/>')
_PARAGRAPH = re.compile(r'<div sID="[^"]*" type="x-p"/>|<chapter [^>]*sID="[^"]*"/>|<lb\b[^>]*/>')
_TAG = re.compile(r"<[^>]+>")
_SPACES = re.compile(r"[ \t]+")
# match the ASCII conventions of the Austen texts
_PUNCT = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"', "\u2014": "--"})


def read_blocks(module_dir: Path, testament: str) -> list[str]:
    """Decompress every block of one testament (``ot`` or ``nt``)."""
    index = (module_dir / f"{testament}.bzs").read_bytes()
    blob = (module_dir / f"{testament}.bzz").read_bytes()
    blocks = []
    for start in range(0, len(index), 12):
        offset, size, _plain_size = struct.unpack("<III", index[start : start + 12])
        if size:
            blocks.append(zlib.decompress(blob[offset : offset + size]).decode("utf-8"))
    return blocks


def osis_to_text(osis: str) -> str:
    """Strip OSIS markup to paragraphs of plain text; footnotes and headings are dropped."""
    text = _NOTE.sub("", osis)
    text = _TITLE.sub("", text)
    text = _PARAGRAPH.sub("\n\n", text)
    text = html.unescape(_TAG.sub("", text)).translate(_PUNCT)
    paragraphs = (_SPACES.sub(" ", p.replace("\n", " ")).strip() for p in text.split("\n\n"))
    return "\n\n".join(p for p in paragraphs if p)


def book_title(osis: str) -> str:
    match = _BOOK_TITLE.search(osis)
    return match.group(1) if match else "untitled"


def read_module(module_dir: Path) -> list[tuple[str, str]]:
    """(title, text) for every book of the module, Old Testament first."""
    books: list[tuple[str, str]] = []
    for testament in ("ot", "nt"):
        if (module_dir / f"{testament}.bzs").exists():
            books.extend((book_title(b), osis_to_text(b)) for b in read_blocks(module_dir, testament))
    return [(title, text) for title, text in books if text]
