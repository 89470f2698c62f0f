"""RankRouter: which data-parallel rank serves a new request, and which rank owns each request.

The least-loaded rank (its running + waiting requests, counted here exactly: assigned and not yet
finished), unless a rank that was given the longest shared prompt prefix (in steps of PREFIX_STEP
tokens) has at most PREFIX_SLACK more requests: its prefix cache likely still holds those blocks.
"""

from __future__ import annotations

from collections import OrderedDict

PREFIX_STEP = 16  # prompt prefixes are remembered in steps of this many tokens
PREFIX_MEMORY = 8192  # prefixes remembered (least recently used forgotten first)
PREFIX_SLACK = 2


class RankRouter:
    def __init__(self, num_ranks: int) -> None:
        self.load = [0] * num_ranks
        self.owner: dict[str, int] = {}
        self._prefixes: OrderedDict[int, int] = OrderedDict()

    def assign(self, request_id: str, prompt: list[int]) -> int:
        rank = self._choose(prompt)
        self.owner[request_id] = rank
        self.load[rank] += 1
        return rank

    def forget(self, request_id: str) -> None:
        """The request finished (or was refused): it no longer loads its rank."""
        rank = self.owner.pop(request_id, None)
        if rank is not None:
            self.load[rank] -= 1

    def by_owner(self, request_ids: list[str]) -> dict[int, list[str]]:
        groups: dict[int, list[str]] = {}
        for request_id in request_ids:
            if request_id in self.owner:
                groups.setdefault(self.owner[request_id], []).append(request_id)
        return groups

    def _choose(self, prompt: list[int]) -> int:
        least = min(range(len(self.load)), key=lambda r: (self.load[r], r))
        keys = _prefix_keys(prompt)
        chosen = least
        for key in reversed(keys):
            rank = self._prefixes.get(key)
            if rank is not None and self.load[rank] <= self.load[least] + PREFIX_SLACK:
                chosen = rank
                break
        for key in keys:
            self._prefixes[key] = chosen
            self._prefixes.move_to_end(key)
        while len(self._prefixes) > PREFIX_MEMORY:
            self._prefixes.popitem(last=False)
        return chosen


def _prefix_keys(prompt: list[int]) -> list[int]:
    """Chained hashes of the prompt's first PREFIX_STEP, 2 * PREFIX_STEP, ... tokens."""
    keys, h = [], 0
    for end in range(PREFIX_STEP, len(prompt) + 1, PREFIX_STEP):
        h = hash((h, tuple(prompt[end - PREFIX_STEP : end])))
        keys.append(h)
    return keys
