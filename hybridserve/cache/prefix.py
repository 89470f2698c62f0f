"""Prefix hashes: one chained hash per full logical block of token ids."""

from __future__ import annotations

import hashlib
import struct


def block_hashes(
    token_ids: list[int], block_tokens: int, parent: bytes = b"", start_block: int = 0, salt: bytes = b""
) -> list[bytes]:
    """Hashes of the full blocks from ``start_block`` on; each covers its whole prefix.

    ``parent`` is the hash of block ``start_block - 1`` (empty for the first block); ``salt``
    carries anything else that changes the KV (a model revision, later a LoRA id).
    """
    hashes: list[bytes] = []
    prev = parent
    for j in range(start_block, len(token_ids) // block_tokens):
        chunk = token_ids[j * block_tokens : (j + 1) * block_tokens]
        h = hashlib.sha256(salt + prev + struct.pack(f"<{len(chunk)}q", *chunk)).digest()[:16]
        hashes.append(h)
        prev = h
    return hashes
