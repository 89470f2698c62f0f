"""A plain radix tree over token blocks: the reference for which prefixes should be reusable.

It shares no code with the prefix cache under test: no hashes, no ``lookup``. It learns only facts
the engine cannot hide: which tokens a request has computed into which physical blocks (its block
tables, when the engine offers new blocks for reuse) and which blocks an allocation hands out again
(their old contents are gone). From those it decides on its own which prefixes can be resumed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridserve.cache.arena import ArenaBlockPool
from hybridserve.cache.coordinator import KvCacheCoordinator
from hybridserve.cache.plan import CachePlan
from hybridserve.cache.spec import GroupKind

NULL = 0


@dataclass(eq=False)
class _Node:
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    copies: dict[str, int] = field(default_factory=dict)  # group -> the one block findable for it


class RadixOracle:
    """Remembers every block-aligned prefix the engine has computed and where it lives.

    A block becomes findable when it is first computed, unless a findable copy of the same prefix
    block already exists (first writer wins); it stops being findable when its physical block is
    handed out again or the cache is reset. A prefix of n blocks is reusable when the tree holds it,
    every history group has all n blocks findable, and every window group has the blocks covering
    the ``window_tokens`` tokens before token n * B (what the next token can see).
    """

    def __init__(self, plan: CachePlan) -> None:
        self.block_tokens = plan.block_tokens
        self.groups = {g.spec.name: (g.spec.kind, g.spec.window_tokens) for g in plan.groups}
        self.root = _Node()
        self._holders: dict[str, dict[int, _Node]] = {name: {} for name in self.groups}
        self._offered: dict[str, int] = {}  # request -> full blocks already offered

    def watch(self, coordinator: KvCacheCoordinator) -> None:
        """Follow an engine's coordinator: computed blocks, released requests, re-handed-out blocks."""
        publish, release = coordinator.publish, coordinator.release

        def published(req_id: str, token_ids: list[int], num_computed: int) -> None:
            publish(req_id, token_ids, num_computed)
            self.computed(req_id, token_ids[:num_computed], coordinator.block_tables(req_id))

        def released(req_id: str) -> None:
            release(req_id)
            self._offered.pop(req_id, None)

        coordinator.publish = published  # type: ignore[method-assign]
        coordinator.release = released  # type: ignore[method-assign]
        for name, pool in coordinator.pools.pools.items():
            allocate = pool.allocate

            def handed_out(n: int, name: str = name, allocate=allocate) -> list[int]:  # type: ignore[no-untyped-def]
                blocks: list[int] = allocate(n)
                self.lost(name, blocks)
                return blocks

            pool.allocate = handed_out  # type: ignore[method-assign]
            if isinstance(pool, ArenaBlockPool):
                self._watch_arena(name, pool)

    def _watch_arena(self, name: str, pool: ArenaBlockPool) -> None:
        """Arena pools hand blocks out by pages, and forget cached blocks of a page another group takes."""
        allocate, reclaim = pool.allocate_pages, pool.reclaim_oldest

        def handed_out(n: int, pages: int, spare: int) -> tuple[list[int], int]:
            blocks, used = allocate(n, pages, spare)
            self.lost(name, blocks)
            return blocks, used

        def reclaimed() -> list[int]:
            blocks = reclaim()
            self.lost(name, blocks)
            return blocks

        pool.allocate_pages = handed_out  # type: ignore[method-assign]
        pool.reclaim_oldest = reclaimed  # type: ignore[method-assign]

    def computed(self, req_id: str, tokens: list[int], tables: dict[str, list[int]]) -> None:
        B, node = self.block_tokens, self.root
        first_new = self._offered.get(req_id, 0)
        for j in range(len(tokens) // B):
            node = node.children.setdefault(tuple(tokens[j * B : (j + 1) * B]), _Node())
            if j < first_new:
                continue
            for name, table in tables.items():
                block = table[j] if j < len(table) else NULL
                if block != NULL and name not in node.copies:
                    node.copies[name] = block
                    self._holders[name][block] = node
        self._offered[req_id] = max(first_new, len(tokens) // B)

    def lost(self, group: str, blocks: list[int]) -> None:
        for block in blocks:
            node = self._holders[group].pop(block, None)
            if node is not None:
                del node.copies[group]

    def reset(self) -> None:
        for holders in self._holders.values():
            for node in holders.values():
                node.copies.clear()
            holders.clear()

    def path(self, tokens: list[int]) -> list[_Node]:
        """The tree's nodes along ``tokens``, one per full block, as far as the tree goes."""
        B, node, out = self.block_tokens, self.root, []
        for j in range(len(tokens) // B):
            child = node.children.get(tuple(tokens[j * B : (j + 1) * B]))
            if child is None:
                break
            node = child
            out.append(node)
        return out

    def expected_hit(self, tokens: list[int]) -> int:
        """Tokens a prefix probe must reuse: the longest resumable prefix, one token left to run."""
        B = self.block_tokens
        nodes = self.path(tokens)[: (len(tokens) - 1) // B]
        for n in range(len(nodes), 0, -1):
            if all(self._findable(nodes, n, name) for name in self.groups):
                return n * B
        return 0

    def _findable(self, nodes: list[_Node], n: int, name: str) -> bool:
        kind, window = self.groups[name]
        first = (
            0 if kind is GroupKind.HISTORY else max(0, n * self.block_tokens - window) // self.block_tokens
        )
        return all(name in node.copies for node in nodes[first:n])
