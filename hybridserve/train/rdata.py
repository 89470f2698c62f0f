"""Minimal reader for R's XDR serialization and lazy-load databases (``Rdata.rdx`` + ``Rdata.rdb``).

Only what R data packages of plain vectors need: NULL, symbols, pairlists, character / logical /
integer / double vectors and generic lists (with attributes). Standard library only.
"""

from __future__ import annotations

import gzip
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NILSXP, SYMSXP, LISTSXP, CHARSXP = 0, 1, 2, 9
LGLSXP, INTSXP, REALSXP, STRSXP, VECSXP = 10, 13, 14, 16, 19
REFSXP, NILVALUE_SXP, GLOBALENV_SXP, EMPTYENV_SXP, BASEENV_SXP = 255, 254, 253, 242, 241
NA_INTEGER = -(2**31)


@dataclass
class RObject:
    """An R value: `value` is a Python list/str/None; `attributes` maps attribute names to values."""

    value: Any
    attributes: dict[str, Any] = field(default_factory=dict)

    def names(self) -> list[str]:
        names = self.attributes.get("names")
        return list(names.value) if isinstance(names, RObject) else []


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0
        self.refs: list[Any] = []

    def take(self, n: int) -> bytes:
        chunk = self.data[self.pos : self.pos + n]
        if len(chunk) != n:
            raise ValueError("truncated R serialization stream")
        self.pos += n
        return chunk

    def int32(self) -> int:
        return int(struct.unpack(">i", self.take(4))[0])

    def length(self) -> int:
        n = self.int32()
        if n == -1:
            hi, lo = self.int32(), self.int32()
            n = (hi << 32) + lo
        return n

    def header(self) -> None:
        if self.take(2) != b"X\n":
            raise ValueError("only the XDR ('X') R serialization format is supported")
        version = self.int32()
        self.int32(), self.int32()  # writer and minimal reader versions
        if version == 3:
            self.take(self.int32())  # native encoding name

    def item(self) -> Any:
        flags = self.int32()
        kind, has_attr, has_tag = flags & 0xFF, bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if kind in (NILVALUE_SXP, GLOBALENV_SXP, EMPTYENV_SXP, BASEENV_SXP):
            return None
        if kind == REFSXP:
            index = flags >> 8 or self.int32()
            return self.refs[index - 1]
        if kind == SYMSXP:
            name = self.item()
            self.refs.append(name)
            return name
        if kind == LISTSXP:
            return self.pairlist(has_attr, has_tag)
        if kind == CHARSXP:
            n = self.int32()
            return None if n == -1 else self.take(n).decode("utf-8", errors="replace")
        value = self.vector(kind)
        attributes = self.attributes() if has_attr else {}
        return RObject(value, attributes)

    def vector(self, kind: int) -> list[Any]:
        n = self.length()
        if kind in (LGLSXP, INTSXP):
            ints = struct.unpack(f">{n}i", self.take(4 * n))
            return [None if v == NA_INTEGER else v for v in ints]
        if kind == REALSXP:
            return list(struct.unpack(f">{n}d", self.take(8 * n)))
        if kind in (STRSXP, VECSXP):
            return [self.item() for _ in range(n)]
        raise ValueError(f"unsupported R SEXP type {kind}")

    def pairlist(self, has_attr: bool, has_tag: bool) -> RObject:
        items: dict[str, Any] = {}
        while True:
            if has_attr:
                self.item()
            tag = self.item() if has_tag else None
            items[str(tag) if tag is not None else str(len(items))] = self.item()
            flags = self.int32()
            if flags & 0xFF != LISTSXP:
                if flags & 0xFF != NILVALUE_SXP:
                    raise ValueError("pairlist tail must be NULL")
                return RObject(items)
            has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))

    def attributes(self) -> dict[str, Any]:
        attrs = self.item()
        return dict(attrs.value) if isinstance(attrs, RObject) else {}


def unserialize(data: bytes) -> Any:
    """Decode one XDR-serialized R object."""
    reader = _Reader(data)
    reader.header()
    return reader.item()


def read_lazyload_db(rdx: Path, rdb: Path) -> dict[str, Any]:
    """Read every variable of an R lazy-load database (``.rdx`` index + ``.rdb`` blobs)."""
    index = unserialize(gzip.decompress(rdx.read_bytes()))
    variables = index.value[0]
    blob = rdb.read_bytes()
    out: dict[str, Any] = {}
    for name, entry in zip(variables.names(), variables.value, strict=True):
        offset, size = entry.value
        record = blob[offset : offset + size]
        # 4-byte big-endian uncompressed length, then a zlib stream
        out[name] = unserialize(zlib.decompress(record[4:]))
    return out
