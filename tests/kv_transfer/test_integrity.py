"""Handoff integrity: per-group checksums catch a changed byte and name its group; sides whose plans
differ are refused with the flag that differs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridserve.cache.plan import build_plan
from hybridserve.cache.pool_set import BlockPoolSet
from hybridserve.cache.spec import CacheGroupSpec, GroupKind, RowField
from hybridserve.kv_transfer.handoff import (
    buffer_size,
    checksums,
    corrupt_groups,
    handoff_bytes,
    pack,
    unpack,
)
from hybridserve.kv_transfer.transfer_group import PlanFingerprint
from tests.cache.helpers import toy_specs


def test_a_changed_byte_is_caught_in_its_group_only() -> None:
    plan = build_plan(toy_specs(), 8, 8, 64, num_blocks=16)
    n = 21
    buffer = torch.randint(0, 256, (buffer_size(plan, n),), dtype=torch.uint8)
    sent = checksums(plan, n, buffer)
    assert corrupt_groups(plan, n, buffer, sent) == []
    sizes = handoff_bytes(plan, n)
    last = list(sizes)[-1]
    buffer[sum(sizes.values()) - 1] ^= 1  # the last byte: the last group's
    assert corrupt_groups(plan, n, buffer, sent) == [last]


def _fingerprint(**changes: object) -> PlanFingerprint:
    base = PlanFingerprint("abc", "float32", 16, ("swa_kv window", "csa_rows history"))
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "flag"),
    [
        ({"model": "def"}, "--model"),
        ({"dtype": "bfloat16"}, "--dtype"),
        ({"kv_cache_dtype": "fp8"}, "--kv-cache-dtype"),
        ({"block_tokens": 32}, "--block-tokens"),
        ({"draft_groups": ("mtp_kv",)}, "--speculative-config"),
    ],
)
def test_sides_that_disagree_are_refused_naming_the_flag(changes: dict[str, object], flag: str) -> None:
    ours, theirs = _fingerprint(), _fingerprint(**changes)
    why = ours.mismatch(theirs)
    assert why is not None and flag in why
    assert ours.digest() != theirs.digest()
    assert PlanFingerprint.from_json(theirs.to_json()) == theirs


def test_pack_and_unpack_round_trip_fp8_rows_before_wider_fields() -> None:
    """A fixed FP8 pool keeps its fields in spec order (e4m3 and scale bytes of odd widths, then the rope
    floats), so a float part of the buffer can start at an odd offset (here 3 rows x 7 bytes): it still
    unpacks, byte for byte."""
    fp8 = (RowField("kv.e4m3", 5, torch.uint8), RowField("kv.scale", 2, torch.uint8))
    spec = CacheGroupSpec(
        "rows", GroupKind.HISTORY, 4, (*fp8, RowField("kv.rope", 3, torch.float32)), ("l0",)
    )
    plan = build_plan([spec], 4, 2, 8, num_blocks=6, layout="fixed")
    sender, receiver = BlockPoolSet(plan, "cpu"), BlockPoolSet(plan, "cpu")
    tables = {"rows": [1, 2, 3]}
    for t in sender["rows"].tensors.values():
        t.copy_(torch.arange(t.numel()).view(t.shape).to(t.dtype))
    unpack(receiver, tables, 10, pack(sender, tables, num_tokens=10))  # 3 blocks of one row each
    for key, t in sender["rows"].tensors.items():
        assert torch.equal(receiver["rows"].tensors[key][1:4], t[1:4]), key
