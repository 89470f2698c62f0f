"""Static-shaped, sync-free attention metadata against the computation it replaced (kept below)."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hybridserve.cache.coordinator import KvCacheCoordinator
from hybridserve.cache.plan import build_plan
from hybridserve.cache.pool_set import BlockPoolSet
from hybridserve.engine.core.scheduler import ScheduledRequest
from hybridserve.engine.request import Request, SamplingParams
from hybridserve.engine.worker.batch import build_forward_batch
from hybridserve.engine.worker.prefill_graphs import BLOCK_SIZES
from hybridserve.layers.forward_batch import ForwardBatch
from hybridserve.layers.rope import Rotary
from hybridserve.models.attention_meta import (
    CSA_ROWS,
    CSA_STATE,
    HCA_ROWS,
    HCA_STATE,
    MIN_DECODE_ROWS,
    SPLIT_MIN_TOKENS,
    WINDOW_KV,
    AttentionMeta,
    MetaShapes,
    build_meta,
    decode_meta,
    tie_shapes,
    visible_rows,
)
from hybridserve.models.deepseek_v4 import cache_specs
from hybridserve.models.deepseek_v4_config import CSA, HCA, DeepseekV4Config
from hybridserve.models.loader import read_config

BUNDLED = Path(__file__).resolve().parents[2] / "hybridserve" / "assets" / "austen-v4"

# ---- the metadata as it was computed before (nonzero + a host read of the row count) --------------


@dataclass
class OldCompressed:
    rate: int
    done: torch.Tensor
    src_slots: torch.Tensor
    src_valid: torch.Tensor
    row_positions: torch.Tensor
    row_slots: torch.Tensor
    read_slots: torch.Tensor
    read_visible: torch.Tensor


def old_build_meta(batch: ForwardBatch, window: int, rates: dict[str, int]) -> dict[str, Any]:
    pos, req = batch.positions, batch.req_indices
    token_slots = {
        g: batch.slots(g, 1, pos, req) for g in (WINDOW_KV, CSA_STATE, HCA_STATE) if g in batch.block_tables
    }
    key_pos = pos[:, None] - (window - 1) + torch.arange(window, device=pos.device)
    window_slots = batch.slots(WINDOW_KV, 1, key_pos, req[:, None].expand_as(key_pos))
    csa = hca = None
    if CSA_ROWS in batch.block_tables:
        csa = old_compressed(batch, rates["csa"], CSA_STATE, CSA_ROWS, overlap=True)
    if HCA_ROWS in batch.block_tables:
        hca = old_compressed(batch, rates["hca"], HCA_STATE, HCA_ROWS, overlap=False)
    return {
        "token_slots": token_slots,
        "window_slots": window_slots,
        "window_visible": key_pos >= 0,
        "csa": csa,
        "hca": hca,
    }


def old_compressed(batch: ForwardBatch, m: int, state: str, rows: str, overlap: bool) -> OldCompressed:
    pos, req = batch.positions, batch.req_indices
    dev = pos.device
    done = torch.nonzero((pos + 1) % m == 0).flatten()
    w = (pos[done] + 1) // m - 1
    span = 2 * m if overlap else m
    src_pos = ((w - 1) if overlap else w)[:, None] * m + torch.arange(span, device=dev)
    src_slots = batch.slots(state, 1, src_pos, req[done][:, None].expand_as(src_pos))
    visible_rows = (pos + 1) // m
    n = int(visible_rows.max()) if pos.numel() else 0
    row_ids = torch.arange(n, device=dev)
    per_req = batch.slots(
        rows,
        m,
        row_ids[None].expand(batch.seq_ends.shape[0], n),
        torch.arange(batch.seq_ends.shape[0], device=dev)[:, None].expand(-1, n),
    )
    return OldCompressed(
        rate=m,
        done=done,
        src_slots=src_slots,
        src_valid=src_pos >= 0,
        row_positions=w * m,
        row_slots=batch.slots(rows, m, w, req[done]),
        read_slots=per_req[req],
        read_visible=row_ids[None] < visible_rows[:, None],
    )


# ---- random batches from a real coordinator -----------------------------------------------------

# (csa rate, hca rate, sliding window, block tokens): the bundled model's and smaller ones.
GEOMETRIES = [(4, 16, 64, 16), (2, 8, 6, 8), (4, 4, 5, 8), (2, 16, 8, 16)]
KINDS = ("prefill", "chunk", "decode", "prefix", "boundary")


def _config(csa: int, hca: int, window: int) -> DeepseekV4Config:
    cfg = DeepseekV4Config.from_dict(read_config(BUNDLED))
    return dataclasses.replace(cfg, compress_rates={CSA: csa, HCA: hca}, sliding_window=window)


class Scenario:
    """A coordinator holding requests at random points of their life, and the step that runs them."""

    def __init__(self, geometry: tuple[int, int, int, int], seed: int) -> None:
        csa, hca, window, block = geometry
        self.cfg = _config(csa, hca, window)
        plan = build_plan(cache_specs(self.cfg, torch.float32), block, 8, 512, num_blocks=400)
        self.coord = KvCacheCoordinator(plan, BlockPoolSet(plan, "cpu"), enable_prefix_caching=True)
        self.rng = random.Random(seed)
        self.block = block
        self.scheduled: list[ScheduledRequest] = []
        self.kinds: list[str] = []

    def add(self, kind: str) -> None:
        rng, rid = self.rng, f"r{len(self.scheduled)}"
        tokens = [rng.randrange(3, 4000) for _ in range(rng.randrange(2, 120))]
        start = 0
        if kind == "prefix":
            start = self._admit_prefix(rid, tokens)
        elif kind in ("chunk", "decode"):
            start = rng.randrange(1, len(tokens))
            self._advance(rid, start)
        elif kind == "boundary":  # just before or at a window end of either branch, a few tokens
            m = rng.choice(list(self.cfg.compress_rates.values()))
            start = min(len(tokens) - 1, m * rng.randrange(1, 8) - rng.randrange(2))
            self._advance(rid, start)
        n = 1 if kind == "decode" else rng.randrange(1, len(tokens) - start + 1)
        if kind == "boundary":
            n = min(n, 3)
        assert self.coord.allocate(rid, start, start + n)
        self.scheduled.append(ScheduledRequest(Request(rid, tokens, SamplingParams()), start, n))
        self.kinds.append(kind)

    def _advance(self, rid: str, end: int) -> None:
        """Allocate [0, end) in a few chunks, as earlier steps would (window blocks get recycled)."""
        pos = 0
        while pos < end:
            step = min(end - pos, self.rng.randrange(1, 40))
            assert self.coord.allocate(rid, pos, pos + step)
            pos += step

    def _admit_prefix(self, rid: str, tokens: list[int]) -> int:
        """A finished donor with the same tokens published its blocks; ``rid`` starts from the hit."""
        donor = f"{rid}-donor"
        n = self.rng.randrange(self.block + 1, len(tokens) + 1) if len(tokens) > self.block else len(tokens)
        self._advance(donor, n)
        self.coord.publish(donor, tokens, n)
        self.coord.release(donor)
        hit = self.coord.probe(tokens)
        if hit.num_tokens:
            self.coord.admit_prefix(rid, hit, tokens)
        else:
            self._advance(rid, 0)
        return hit.num_tokens

    def batch(self, pad_windows: bool = False) -> ForwardBatch:
        return build_forward_batch(self.scheduled, self.coord, torch.device("cpu"), pad_windows=pad_windows)


def _scenarios() -> Iterator[tuple[tuple[int, int, int, int], int, list[str]]]:
    rng = random.Random(0)
    mixes = [["decode"] * 5, ["prefill"], ["chunk", "chunk"], ["prefix"], ["prefix", "decode", "chunk"]]
    mixes += [["boundary"] * 4, ["boundary", "decode", "prefix"], ["decode", "prefill", "decode", "chunk"]]
    mixes += [[rng.choice(KINDS) for _ in range(rng.randrange(1, 7))] for _ in range(10)]
    for g, geometry in enumerate(GEOMETRIES):
        for i, kinds in enumerate(mixes):
            yield geometry, 100 * g + i, kinds


def _rotary(cfg: DeepseekV4Config) -> dict[str, Rotary]:
    return {name: Rotary(r, "cpu") for name, r in cfg.rope.items()}


def _meta(s: Scenario, batch: ForwardBatch) -> AttentionMeta:
    rates = {"csa": s.cfg.compress_rates[CSA], "hca": s.cfg.compress_rates[HCA]}
    return build_meta(batch, s.cfg.sliding_window, rates, _rotary(s.cfg), torch.float32)


def _equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(a, b)


def _token_blocks(meta: AttentionMeta, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(query block, row in the block) of every token."""
    rows = meta.blocks.token_rows
    rows = torch.arange(tokens) if rows is None else rows
    return rows // meta.blocks.size, rows % meta.blocks.size


def _groups(meta: AttentionMeta, tokens: int) -> list[tuple[AttentionMeta, torch.Tensor]]:
    """(reads, step rows) of each query group: the step's, or the main group's and the decodes'."""
    if meta.split is None:
        return [(meta, torch.arange(tokens))]
    split = meta.split
    assert split.decode.blocks.size == 1 and split.decode_rows.numel() >= 2
    rows = torch.cat([split.main_rows, split.decode_rows])
    _equal(rows.sort().values, torch.arange(tokens))  # every token in one group
    return [(meta, split.main_rows), (split.decode, split.decode_rows)]


def _check_window(new: AttentionMeta, old: dict[str, Any], tokens: int) -> None:
    """Each token's visible window slots, in key order, are the old per-token ones; padded queries see
    nothing."""
    for reads, rows in _groups(new, tokens):
        b, i = _token_blocks(reads, rows.numel())
        visible = reads.window_visible[b, i]
        old_visible = old["window_visible"][rows]
        _equal(visible.sum(1), old_visible.sum(1))
        _equal(reads.window_slots[b][visible], old["window_slots"][rows][old_visible])
        assert int(reads.window_visible.sum()) == int(visible.sum())


def _check_branch(name: str, old: OldCompressed, rotary: Rotary, meta: AttentionMeta) -> None:
    for reads, token_rows in _groups(meta, old.read_slots.shape[0]):
        branch = getattr(reads, name)
        b, i = _token_blocks(reads, token_rows.numel())
        _equal(branch.read_slots[b], old.read_slots[token_rows])
        _equal(branch.read_visible[b, i], old.read_visible[token_rows])
        rows = b * reads.blocks.size + i
        _equal(branch.read_count[rows], old.read_visible[token_rows].sum(dim=1, keepdim=True))
        assert int(branch.read_count.sum()) == int(branch.read_count[rows].sum())  # padding sees no row
    new = getattr(meta, name)
    k = old.done.numel()
    rows = new.new_rows
    if rows is None:
        assert k == 0
        return
    assert rows.count == k
    _equal(rows.src_slots[:k], old.src_slots)
    _equal(rows.src_valid[:k], old.src_valid)
    _equal(rows.positions[:k], old.row_positions)
    _equal(rows.slots[:k], old.row_slots)
    cos, sin = rotary.cos_sin(old.row_positions, torch.float32)
    _equal(rows.rope[0][:k], cos)
    _equal(rows.rope[1][:k], sin)
    # padding: reads the state group's null block, writes the row group's null block
    assert not rows.src_slots[k:].any() and not rows.slots[k:].any()


SCENARIOS = list(_scenarios())


@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize(("geometry", "seed", "kinds"), SCENARIOS)
def test_meta_equals_the_old_computation(
    geometry: tuple[int, int, int, int], seed: int, kinds: list[str], pad: bool
) -> None:
    s = Scenario(geometry, seed)
    for kind in kinds:
        s.add(kind)
    batch = s.batch(pad_windows=pad)
    rates = {"csa": s.cfg.compress_rates[CSA], "hca": s.cfg.compress_rates[HCA]}
    new, old = _meta(s, batch), old_build_meta(batch, s.cfg.sliding_window, rates)
    assert new.token_slots.keys() == old["token_slots"].keys()
    for g, slots in old["token_slots"].items():
        _equal(new.token_slots[g], slots)
    _check_window(new, old, batch.num_tokens)
    rotary = _rotary(s.cfg)["compress"]
    for name in ("csa", "hca"):
        branch = getattr(new, name)
        assert branch is not None
        _check_branch(name, old[name], rotary, new)
        if pad:
            rows = branch.new_rows
            assert rows is not None
            m = branch.rate
            bound = sum(-(-x.num_tokens // m) for x in s.scheduled)
            assert rows.slots.shape[0] == max(bound, 2)  # never a dim of 1


def test_prefix_scenarios_start_from_a_hit_with_null_window_blocks() -> None:
    """The 'prefix' kind really exercises prefix-cache starts (window tables led by null blocks)."""
    starts = []
    for geometry, seed, kinds in SCENARIOS:
        if "prefix" not in kinds:
            continue
        s = Scenario(geometry, seed)
        for kind in kinds:
            s.add(kind)
        for sched, kind in zip(s.scheduled, kinds, strict=True):
            if kind == "prefix" and sched.start:
                starts.append(sched.start)
                tables = s.coord.block_tables(sched.request.request_id)
                if sched.start > s.cfg.sliding_window + s.block:
                    assert tables[WINDOW_KV][0] == 0
    assert len(starts) >= 5


@pytest.mark.parametrize(
    ("kinds", "split"),
    [
        (["decode", "prefill", "decode", "chunk", "prefill"], True),
        (["prefill", "decode", "decode", "prefill", "prefill"], True),
        (["decode", "prefill"], False),  # one decode: a dim of 1 in a compiled step
        (["decode"] * 5, False),
        (["prefill", "chunk"], False),
    ],
)
def test_mixed_steps_read_their_decodes_apart(kinds: list[str], split: bool) -> None:
    """Two or more one-token requests beside longer chunks get their own one-query blocks; the main
    group's blocks cover only the other requests' tokens."""
    s = Scenario(GEOMETRIES[1], 11)
    for kind in kinds:
        s.add(kind)
    batch = s.batch()
    meta = _meta(s, batch)
    counts = [x.num_tokens for x in s.scheduled]
    if split:  # the scenario has what a split needs: two decodes, SPLIT_MIN_TOKENS others
        assert sum(n for n in counts if n > 1) >= SPLIT_MIN_TOKENS and counts.count(1) >= 2
    assert (meta.split is not None) == split
    if meta.split is None:
        return
    firsts = [sum(counts[:r]) for r in range(len(counts))]
    decode_rows = [f for f, n in zip(firsts, counts, strict=True) if n == 1]
    assert meta.split.decode_rows.tolist() == decode_rows
    assert meta.blocks.size > 1
    padded = meta.blocks.padded if meta.blocks.token_rows is not None else meta.split.main_rows.numel()
    assert meta.window_slots.shape[0] * meta.blocks.size == padded


COMPILED_ROWS = 64  # each branch's padded row reads in the compiled form: past what these steps see


@pytest.mark.parametrize(
    "kinds",
    [
        ["decode", "prefill", "decode", "chunk", "prefill"],
        ["decode", "prefill"],
        ["prefill", "chunk"],
        ["decode"] * 5,
        ["decode", "decode", "boundary"],
    ],
)
def test_compiled_steps_always_read_their_decodes_apart(kinds: list[str]) -> None:
    """A compiled step's metadata (``MetaShapes``) always comes split, so that one graph serves steps with
    and without decodes: the decodes are those the eager form reads apart (none where it reads none), and
    filler entries up to two repeat the first main token's row. Every entry, filler included, reads its
    token's window and compressed rows as the old per-token computation does."""
    s = Scenario(GEOMETRIES[1], 11)
    for kind in kinds:
        s.add(kind)
    batch = s.batch(pad_windows=True)
    rates = {"csa": s.cfg.compress_rates[CSA], "hca": s.cfg.compress_rates[HCA]}
    assert max(visible_rows(batch.host_layout(), m) for m in rates.values()) <= COMPILED_ROWS
    shapes = MetaShapes(BLOCK_SIZES, {"csa": COMPILED_ROWS, "hca": COMPILED_ROWS})
    meta = build_meta(batch, s.cfg.sliding_window, rates, _rotary(s.cfg), torch.float32, shapes)
    split = meta.split
    assert split is not None and split.decode.blocks.size == 1
    counts = [x.num_tokens for x in s.scheduled]
    firsts = [sum(counts[:r]) for r in range(len(counts))]
    eager = _meta(s, batch).split
    decodes = [r for r, n in enumerate(counts) if n == 1] if eager is not None else []
    main = [r for r in range(len(counts)) if r not in decodes]
    assert split.decodes == len(decodes) and split.decode_rows.numel() == max(len(decodes), MIN_DECODE_ROWS)
    fill = [firsts[main[0]]] * (split.decode_rows.numel() - len(decodes))
    assert split.decode_rows.tolist() == [firsts[r] for r in decodes] + fill
    assert split.main_rows.tolist() == [t for r in main for t in range(firsts[r], firsts[r] + counts[r])]
    old = old_build_meta(batch, s.cfg.sliding_window, rates)
    rows, reads = split.decode_rows, split.decode
    visible = reads.window_visible[:, 0]
    _equal(visible.sum(1), old["window_visible"][rows].sum(1))
    _equal(reads.window_slots[visible], old["window_slots"][rows][old["window_visible"][rows]])
    for name in ("csa", "hca"):
        branch, reference = getattr(reads, name), old[name]
        n = reference.read_slots.shape[1]
        _equal(branch.read_visible[:, 0, :n], reference.read_visible[rows])
        assert not branch.read_visible[:, 0, n:].any()
        _equal(branch.read_slots[:, :n], reference.read_slots[rows])


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize(("geometry", "seed", "kinds"), SCENARIOS)
def test_the_sizes_a_trace_is_told_hold(
    geometry: tuple[int, int, int, int], seed: int, kinds: list[str], compiled: bool
) -> None:
    """``tie_shapes`` states to a compiled trace which sizes of the metadata are equal: every statement
    holds for real steps, in the eager form and in the compiled one (split, rows padded), so the graph it
    shapes never refuses one. A metadata whose blocks disagree is refused."""
    s = Scenario(geometry, seed)
    for kind in kinds:
        s.add(kind)
    batch = s.batch(pad_windows=compiled)
    rates = {"csa": s.cfg.compress_rates[CSA], "hca": s.cfg.compress_rates[HCA]}
    seen = {name: visible_rows(batch.host_layout(), m) for name, m in rates.items()}
    shapes = MetaShapes(BLOCK_SIZES, {name: max(2, n) + 3 for name, n in seen.items()}) if compiled else None
    meta = build_meta(batch, s.cfg.sliding_window, rates, _rotary(s.cfg), torch.float32, shapes)
    assert (meta.split is not None) or not compiled
    tie_shapes(meta, batch.num_tokens)
    broken = dataclasses.replace(meta, window_slots=torch.cat([meta.window_slots, meta.window_slots[:1]]))
    with pytest.raises(RuntimeError):
        tie_shapes(broken, batch.num_tokens)


def test_hand_built_batch_derives_the_same_layout() -> None:
    s = Scenario(GEOMETRIES[1], 7)
    for kind in ("decode", "chunk", "prefix", "prefill"):
        s.add(kind)
    batch = s.batch()
    bare = dataclasses.replace(batch, layout=None)
    assert bare.host_layout() == batch.layout
    a, b = _meta(s, batch), _meta(s, bare)
    assert a.csa is not None and b.csa is not None
    _equal(a.csa.read_slots, b.csa.read_slots)


def _decode_shapes(seed: int, reqs: int) -> list[tuple[str, tuple[int, ...]]]:
    s = Scenario(GEOMETRIES[0], seed)
    for _ in range(reqs):
        s.add("decode")
    meta = _meta(s, s.batch(pad_windows=True))
    shapes = []
    for name in ("csa", "hca"):
        branch = getattr(meta, name)
        assert branch is not None and branch.new_rows is not None
        rows = branch.new_rows
        for field in ("src_slots", "src_valid", "positions", "slots"):
            shapes.append((f"{name}.{field}", tuple(getattr(rows, field).shape)))
        shapes.append((f"{name}.read_count", tuple(branch.read_count.shape)))
    shapes += [(f"token.{g}", tuple(t.shape)) for g, t in meta.token_slots.items()]
    shapes.append(("window", tuple(meta.window_slots.shape)))
    return shapes


def test_padded_decode_batch_shapes_do_not_depend_on_positions() -> None:
    reference = _decode_shapes(0, 4)
    for seed in range(1, 12):
        assert _decode_shapes(seed, 4) == reference


@pytest.mark.parametrize("extra_rows", [0, 5])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_decode_meta_equals_build_meta(
    geometry: tuple[int, int, int, int], seed: int, extra_rows: int
) -> None:
    """The compiled step's device-only metadata is the host-layout one: same slots, rope and visibility;
    rows read past N are never visible; each request's window entry is the window it completes, or
    pooled into the null block."""
    s = Scenario(geometry, seed)
    for _ in range(1 + seed % 5):
        s.add("decode")
    batch = s.batch(pad_windows=True)
    ref = _meta(s, batch)
    layout = batch.host_layout()
    rates = {"csa": s.cfg.compress_rates[CSA], "hca": s.cfg.compress_rates[HCA]}
    rows = {name: torch.arange(visible_rows(layout, m) + extra_rows) for name, m in rates.items()}
    top = max(layout.ends) + 64
    got = decode_meta(batch, rows, top, s.cfg.sliding_window, rates, _rotary(s.cfg), torch.float32)
    for g, slots in ref.token_slots.items():
        _equal(got.token_slots[g], slots)
    _equal(got.window_slots, ref.window_slots)
    _equal(got.window_visible, ref.window_visible)
    for name, (cos, sin) in ref.rope.items():
        _equal(got.rope[name][0], cos)
        _equal(got.rope[name][1], sin)
    for name in ("csa", "hca"):
        a, b = getattr(got, name), getattr(ref, name)
        assert a is not None and b is not None and a.new_rows is not None and b.new_rows is not None
        n = b.read_slots.shape[1]
        _equal(a.read_slots[:, :n], b.read_slots)
        _equal(a.read_visible[..., :n], b.read_visible)
        assert not a.read_visible[..., n:].any()
        _equal(a.read_count, b.read_count)
        done = [i for i, x in enumerate(s.scheduled) if (x.start + 1) % b.rate == 0]
        k = b.new_rows.count
        assert k == len(done)
        for field in ("src_slots", "positions", "slots"):
            _equal(getattr(a.new_rows, field)[done], getattr(b.new_rows, field)[:k])
        _equal(a.new_rows.rope[0][done], b.new_rows.rope[0][:k])
        idle = [i for i in range(len(s.scheduled)) if i not in done]
        assert not a.new_rows.src_slots[idle].any() and not a.new_rows.slots[idle].any()


class _SyncWatch(TorchDispatchMode):
    """Records ops that read a device value on the host (a sync off the CPU)."""

    SYNCING = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "aminmax")

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.__name__
        if any(s in name for s in self.SYNCING):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


@contextmanager
def _no_tolist() -> Iterator[None]:
    original = torch.Tensor.tolist

    def refuse(self: torch.Tensor) -> Any:
        raise AssertionError("tolist() reads device values")

    torch.Tensor.tolist = refuse  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.tolist = original  # type: ignore[method-assign]


@pytest.mark.parametrize("kinds", [["decode"] * 6, ["prefix", "chunk", "decode"]])
def test_build_meta_reads_no_device_value(kinds: list[str]) -> None:
    s = Scenario(GEOMETRIES[0], 3)
    for kind in kinds:
        s.add(kind)
    batch = s.batch(pad_windows=True)
    rates = {"csa": s.cfg.compress_rates[CSA], "hca": s.cfg.compress_rates[HCA]}
    rotary = _rotary(s.cfg)  # the table lookup takes its bound from the host layout: no read-back
    watch = _SyncWatch()
    with _no_tolist(), watch:
        build_meta(batch, s.cfg.sliding_window, rates, rotary, torch.float32)
    assert watch.seen == []


def test_prefill_reads_in_query_blocks_and_decode_per_query() -> None:
    """Prefill and mixed steps group their queries (Q > 1, padded unless every block is full); a decode
    step does not."""
    sizes = {}
    for kinds in (["decode"] * 5, ["prefill", "prefill"], ["prefill", "decode", "decode"]):
        s = Scenario(GEOMETRIES[0], 3)
        for kind in kinds:
            s.add(kind)
        meta = _meta(s, s.batch())
        sizes[kinds[0] + str(len(kinds))] = meta.blocks.size
        if meta.blocks.size > 1:
            tokens = len(s.batch().input_ids)
            padded = tokens if meta.blocks.token_rows is None else meta.blocks.padded
            assert padded is not None and meta.window_slots.shape[0] * meta.blocks.size == padded
            assert (meta.blocks.token_rows is None) == (padded == tokens)  # pad rows only where needed
    assert sizes["decode5"] == 1
    assert sizes["prefill2"] > 1 and sizes["prefill3"] > 1
