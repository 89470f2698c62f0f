"""Process-group bootstrap: a TCPStore rendezvous, then gloo (CPU) or NCCL (CUDA) over N ranks.

Every multi-process shape (expert parallelism, disaggregation) starts here. Each group gets a gloo
"control" group on the CPU as well, for the small host-side agreements (whether anyone has work, how
many rows each rank sends) that NCCL would force through the device.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

# A collective that waits this long is a dead or wedged peer, not a slow step.
DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class GroupAddress:
    """Where rank 0's TCPStore listens; every rank of the world connects there."""

    host: str
    port: int


@dataclass
class ProcessGroup:
    """One world: ``device_group`` carries tensors (NCCL on CUDA), ``cpu_group`` small host ones (gloo)."""

    rank: int
    world_size: int
    device: torch.device
    device_group: dist.ProcessGroup
    cpu_group: dist.ProcessGroup
    store: dist.Store
    timeout_s: float

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_group(
    address: GroupAddress,
    rank: int,
    world_size: int,
    device: torch.device,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> ProcessGroup:
    """Join the world of ``world_size`` ranks at ``address`` (rank 0 hosts the store); blocks until all
    have joined or ``timeout_s`` passes (then raises, naming the address)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(
            address.host,
            address.port,
            world_size,
            is_master=rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
        dist.init_process_group(
            backend_for(device),
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
        )
    except (RuntimeError, dist.DistError) as exc:
        raise RuntimeError(
            f"rank {rank} of {world_size} could not join the process group at {address.host}:{address.port} "
            f"within {timeout_s:.0f} s: {exc}"
        ) from exc
    world = dist.group.WORLD
    assert world is not None
    cpu_group = world if device.type != "cuda" else dist.new_group(backend="gloo", timeout=timeout)
    return ProcessGroup(rank, world_size, device, world, cpu_group, store, timeout_s)
