"""Corpus extraction without the Debian download: R lazy-load databases and SWORD OSIS text."""

from __future__ import annotations

import gzip
import struct
import zlib
from pathlib import Path

from hybridserve.train.corpus import Document, lines_to_paragraphs, split_tail
from hybridserve.train.rdata import read_lazyload_db, unserialize
from hybridserve.train.sword import osis_to_text

HEADER = b"X\n" + struct.pack(">iii", 3, 0x040201, 0x030500) + struct.pack(">i", 5) + b"UTF-8"
NIL = struct.pack(">i", 254)


def r_char(text: str | None) -> bytes:
    if text is None:
        return struct.pack(">ii", 9, -1)
    raw = text.encode()
    return struct.pack(">ii", 0x00040009, len(raw)) + raw


def r_strings(items: list[str | None]) -> bytes:
    return struct.pack(">ii", 16, len(items)) + b"".join(r_char(s) for s in items)


def r_ints(values: list[int]) -> bytes:
    return struct.pack(f">ii{len(values)}i", 13, len(values), *values)


def r_named_list(items: dict[str, bytes]) -> bytes:
    body = struct.pack(">ii", 19 | (1 << 9), len(items)) + b"".join(items.values())
    names_attr = struct.pack(">i", 2 | (1 << 10)) + struct.pack(">i", 1) + r_char("names")
    return body + names_attr + r_strings(list(items)) + NIL


def write_lazyload_db(folder: Path, variables: dict[str, list[str | None]]) -> None:
    blob, index = b"", {}
    for name, lines in variables.items():
        raw = HEADER + r_strings(lines)
        record = struct.pack(">I", len(raw)) + zlib.compress(raw)
        index[name] = r_ints([len(blob), len(record)])
        blob += record
    rdx = HEADER + r_named_list(
        {"variables": r_named_list(index), "references": r_named_list({}), "compressed": r_ints([1])}
    )
    (folder / "Rdata.rdx").write_bytes(gzip.compress(rdx))
    (folder / "Rdata.rdb").write_bytes(blob)


def test_unserialize_character_vector() -> None:
    obj = unserialize(HEADER + r_strings(["Emma", "", None, "café"]))
    assert obj.value == ["Emma", "", None, "café"]


def test_read_lazyload_db(tmp_path: Path) -> None:
    novels = {
        "emma": ["EMMA", "", "Emma Woodhouse, handsome,", "clever, and rich."],
        "persuasion": ["Sir Walter"],
    }
    write_lazyload_db(tmp_path, novels)
    db = read_lazyload_db(tmp_path / "Rdata.rdx", tmp_path / "Rdata.rdb")
    assert {k: v.value for k, v in db.items()} == novels


def test_paragraphs_and_heldout_split() -> None:
    text = lines_to_paragraphs(["CHAPTER I", "", "", "One  two", "three.", "", "Four.", None, "Five."])
    assert text == "CHAPTER I\n\nOne two three.\n\nFour.\n\nFive."
    head, tail = split_tail(Document("austen", "x", text), 0.1)
    assert tail == "Five."
    assert head.text + "\n\n" + tail == text


def test_osis_to_text() -> None:
    osis = (
        '<title type="main">Genesis</title><div sID="a" type="x-p"/>'
        '<chapter n="1" osisID="Gen.1" sID="Gen.1"/>'
        '<w lemma="strong:H7225">In</w> the beginning<note placement="foot">a footnote</note>, '
        'God\u2019s \u201cword\u201d\u2014light.<div sID="b" type="x-p"/>And it was so &amp; good.'
    )
    assert osis_to_text(osis) == 'In the beginning, God\'s "word"--light.\n\nAnd it was so & good.'
