"""What the engine tells the world about itself: the only engine state the server reads.

EngineCore keeps ``EngineStats``; between steps it takes an ``EngineSnapshot`` (requests, KV blocks per
cache group, prefix-cache and speculative counters, KV handoffs, expert-parallel load), which the
engine-core process sends with its outputs and the server's /metrics reads. The server never reaches
into the scheduler, the coordinator or the pools.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridserve.kv_transfer.records import HandoffStats

__all__ = ["ArenaUsage", "EngineSnapshot", "EngineStats", "HandoffStats", "PoolUsage"]


@dataclass
class EngineStats:
    """The core's own running counters (the scheduler and the pools keep the rest)."""

    generation_tokens: int = 0
    steps: int = 0
    failed_steps: int = 0
    consecutive_failures: int = 0
    finished: dict[str, int] = field(default_factory=dict)


@dataclass
class PoolUsage:
    """One cache group's blocks: in use, usable in all, findable by prefix, evicted so far."""

    used: int
    total: int
    cached: int
    evicted: int = 0
    pages: int = 0  # arena pages this group holds (its share of the arena; 0 with fixed pools)


@dataclass
class ArenaUsage:
    """The cache arena every group draws pages from (--cache-layout arena)."""

    page_bytes: int
    pages_total: int  # pages groups may take (the null page excluded)
    pages_free: int  # held by no group
    pages_parked: int  # held only for cached prefixes: reclaimable by any group
    pages_reclaimed: int  # parked pages taken back, their cached blocks forgotten


@dataclass
class EngineSnapshot:
    """What the engine's metrics read, taken between steps (it crosses the process boundary)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks: dict[str, PoolUsage] = field(default_factory=dict)  # cache group -> its blocks
    arena: ArenaUsage | None = None
    prompt_tokens: int = 0
    prefix_hit_tokens: int = 0
    num_preemptions: int = 0
    generation_tokens: int = 0
    steps: int = 0
    failed_steps: int = 0
    steps_by_path: dict[str, int] = field(default_factory=dict)  # ModelRunner.execute's paths -> steps
    drafts_by_path: dict[str, int] = field(default_factory=dict)  # MTP forwards: "graph" / "eager" -> runs
    compiled_ready_s: dict[str, float] = field(default_factory=dict)  # compiled part -> s after start-up
    full_speed_s: float | None = None  # s after start-up when every compiled part was ready (None: not yet)
    dp_rank: int = 0
    expert_tokens: dict[int, int] = field(default_factory=dict)  # routed expert -> rows it ran (EP only)
    collective_s: float = 0.0  # time this rank spent in expert-parallel collectives (EP only)
    handoff: HandoffStats | None = None  # disaggregated workers: KV blocks sent or received
    # Speculative decoding (vLLM's spec_decode counters); accepted_per_pos[i]: draft i accepted.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    spec_plain_steps: int = 0  # steps load control ran without the drafter (plain steps)
