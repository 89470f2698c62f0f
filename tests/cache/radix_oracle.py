"""A plain radix tree over token blocks: the reference for which prefixes should be reusable."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridserve.cache.coordinator import KvCacheCoordinator
from hybridserve.cache.prefix import block_hashes
from hybridserve.cache.spec import GroupKind


@dataclass
class _Node:
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)


class RadixOracle:
    """Remembers every block-aligned prefix the engine has computed.

    A prefix of n blocks is reusable when the tree holds it, every history group still has all n
    blocks resident, and every window group has the blocks the next token can see.
    """

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.root = _Node()

    def insert(self, tokens: list[int]) -> None:
        node = self.root
        for j in range(len(tokens) // self.block_tokens):
            key = tuple(tokens[j * self.block_tokens : (j + 1) * self.block_tokens])
            node = node.children.setdefault(key, _Node())

    def depth(self, tokens: list[int]) -> int:
        """Blocks of ``tokens`` the tree holds as one path from the root."""
        node, n = self.root, 0
        while True:
            key = tuple(tokens[n * self.block_tokens : (n + 1) * self.block_tokens])
            if len(key) < self.block_tokens or key not in node.children:
                return n
            node, n = node.children[key], n + 1

    def expected_hit(self, tokens: list[int], coordinator: KvCacheCoordinator) -> int:
        B = self.block_tokens
        n = min(self.depth(tokens), (len(tokens) - 1) // B)
        hashes = block_hashes(tokens[: n * B], B, salt=coordinator.hash_salt)
        while n > 0:
            if all(
                self._resident(coordinator, g.spec.name, g.spec.kind, g.spec.window_tokens, hashes, n)
                for g in coordinator.plan.groups
            ):
                return n * B
            n -= 1
        return 0

    def _resident(
        self,
        coordinator: KvCacheCoordinator,
        name: str,
        kind: GroupKind,
        window: int,
        hashes: list[bytes],
        n: int,
    ) -> bool:
        first = (
            0 if kind is GroupKind.HISTORY else max(0, n * self.block_tokens - window) // self.block_tokens
        )
        pool = coordinator.pools[name]
        return all(pool.lookup(h) is not None for h in hashes[first:n])
