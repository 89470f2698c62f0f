"""Handoff integrity: per-group checksums catch a changed byte and name its group; sides whose plans
differ are refused with the flag that differs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridserve.cache.plan import build_plan
from hybridserve.kv_transfer.handoff import buffer_size, checksums, corrupt_groups, handoff_bytes
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
