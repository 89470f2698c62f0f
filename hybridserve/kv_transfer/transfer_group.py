"""The process group a prefill worker and a decode worker form at runtime for the KV handoff.

The prefill worker hosts a TCPStore; each decode worker that connects gets its own two-rank group
(rank 0: prefill, rank 1: decode) under a prefix of that store. gloo on CPU, NCCL on CUDA.
Both sides compare a plan fingerprint first: blocks only mean the same thing under the same plan.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hybridserve.cache.plan import CachePlan

PREFILL_RANK, DECODE_RANK = 0, 1


class FingerprintMismatch(RuntimeError):
    pass


@dataclass(frozen=True)
class PlanFingerprint:
    """What both sides of a handoff must agree on: model, dtype, block size and group layout.

    Pool sizes may differ (a decode worker usually has more blocks); the layout of a block may not.
    """

    model: str  # sha256 of the checkpoint's config.json
    dtype: str
    block_tokens: int
    groups: tuple[str, ...]  # one line per group: name, kind, stride, window, rows, layers, fields
    kv_cache_dtype: str = "auto"
    draft_groups: tuple[str, ...] = ()  # a speculative drafter's groups (the MTP window)

    @classmethod
    def of(
        cls, plan: CachePlan, model_folder: str, dtype: torch.dtype, kv_cache_dtype: str = "auto"
    ) -> PlanFingerprint:
        config = Path(model_folder) / "config.json"
        model = hashlib.sha256(config.read_bytes() if config.is_file() else model_folder.encode()).hexdigest()
        groups = tuple(
            f"{g.spec.name} {g.spec.kind.value} stride={g.spec.stride} window={g.spec.window_tokens} "
            f"rows/block={g.rows_per_block} layers={','.join(g.spec.layers)} "
            f"fields={','.join(f'{f.name}:{f.width}:{f.dtype}' for f in g.spec.fields)}"
            for g in plan.groups
        )
        drafts = tuple(g.spec.name for g in plan.groups if g.spec.draft)
        dtype_name = str(dtype).removeprefix("torch.")
        return cls(model[:16], dtype_name, plan.block_tokens, groups, kv_cache_dtype, drafts)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    def digest(self) -> str:
        """A short name of this plan, carried by every handoff record."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    @classmethod
    def from_json(cls, text: str) -> PlanFingerprint:
        data = json.loads(text)
        groups = tuple(data["groups"])
        kv, drafts = str(data.get("kv_cache_dtype", "auto")), tuple(data.get("draft_groups", ()))
        return cls(data["model"], data["dtype"], int(data["block_tokens"]), groups, kv, drafts)

    def mismatch(self, other: PlanFingerprint) -> str | None:
        """Why blocks of ``other``'s plan cannot be read under this one, or None if they can."""
        if self.model != other.model:
            return (
                f"the workers serve different models (config.json sha256 {self.model} vs {other.model}); "
                f"pass the same --model"
            )
        if self.dtype != other.dtype:
            return f"the workers' cache dtypes differ ({self.dtype} vs {other.dtype}); pass the same --dtype"
        if self.kv_cache_dtype != other.kv_cache_dtype:
            return (
                f"the workers' KV cache dtypes differ ({self.kv_cache_dtype} vs {other.kv_cache_dtype}); "
                f"pass the same --kv-cache-dtype"
            )
        if self.block_tokens != other.block_tokens:
            return (
                f"the workers' block sizes differ ({self.block_tokens} vs {other.block_tokens} tokens); "
                f"pass the same --block-tokens"
            )
        if bool(self.draft_groups) != bool(other.draft_groups):
            names = ", ".join(self.draft_groups or other.draft_groups)
            holder = "this worker" if self.draft_groups else "its peer"
            return (
                f"only {holder} keeps the draft window ({names}); "
                f"pass the same --speculative-config to both (the prefill side fills the window the decode "
                f"side drafts from)"
            )
        if self.groups != other.groups:
            ours, theirs = set(self.groups), set(other.groups)
            return (
                f"the workers' cache groups differ: {sorted(ours - theirs)} vs {sorted(theirs - ours)} "
                f"(same model, --dtype and MTP settings on both)"
            )
        return None

    def check(self, other: PlanFingerprint, peer: str) -> None:
        why = self.mismatch(other)
        if why is not None:
            raise FingerprintMismatch(f"KV handoff with {peer} refused: {why}")


# gloo's or NCCL's two-rank backend: its send / recv are real but missing from torch's type stubs.
PairGroup = Any


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def host_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """The prefill worker's rendezvous store (``port`` 0: a free one, read back from ``.port``)."""
    return dist.TCPStore(
        host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
    )


def join_store(address: str, timeout_s: float) -> dist.TCPStore:
    """A decode worker's client of the prefill worker's store at ``host:port``."""
    host, _, port = address.rpartition(":")
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))


def pair_group(
    store: dist.Store, pair_id: str, rank: int, device: torch.device, timeout_s: float
) -> PairGroup:
    """The two-rank group of one (prefill, decode) pair; both sides call this, it returns once both have."""
    prefixed = dist.PrefixStore(f"kv/{pair_id}/", store)
    timeout = timedelta(seconds=timeout_s)
    if backend_for(device) == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, 2, options)
    return dist.ProcessGroupGloo(prefixed, rank, 2, timeout)
