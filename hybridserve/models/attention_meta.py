"""Per-step attention metadata for DeepSeek-V4: every slot a layer reads or writes, computed once.

Rows of a compressed group (stride m) are numbered by window: row w holds tokens [w*m, (w+1)*m)
(CSA row w also reads the first half of window w-1). A query at position p sees rows
w < (p + 1) // m and raw tokens (p - W, p].

Every shape follows from the batch's host-side layout (Python ints), never from reading a device
tensor. With ``BatchLayout.pad_windows`` a decode batch of R requests always gets the same shapes but
for N (the compressed rows it reads) and the block-table width, which grow with the context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridserve.layers.forward_batch import BatchLayout, ForwardBatch, host_tensor
from hybridserve.layers.rope import Rotary

WINDOW_KV = "swa_kv"
CSA_STATE = "csa_state"
HCA_STATE = "hca_state"
CSA_ROWS = "csa_rows"
HCA_ROWS = "hca_rows"
MTP_KV = "mtp_kv"  # the MTP layers' window KV: a draft group, read like WINDOW_KV by those layers


@dataclass
class NewRows:
    """The compressed rows a step completes: where their per-token inputs are and where they go.

    The first ``count`` of the Nw entries are real; padding entries pool the state group's null block
    (zero rows, so a zero row) into slot 0, the null block of the row group. ``count`` is None for
    :func:`decode_meta`'s entries (one per request, in request order; padding is wherever a request's
    token completes no window).
    """

    count: int | None
    src_slots: torch.Tensor  # [Nw, span] state-group slots of the window's per-token inputs
    src_valid: torch.Tensor  # [Nw, span]
    positions: torch.Tensor  # [Nw] rope position of each new row (w * m)
    rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin at ``positions``
    slots: torch.Tensor  # [Nw] history-group slot of each new row


@dataclass
class CompressedMeta:
    """Where one compressed branch (CSA or HCA) writes new rows and which rows each query reads."""

    rate: int
    new_rows: NewRows | None  # None: the step completes no window
    read_slots: torch.Tensor  # [T, N] slots of rows 0..N-1 of each token's request
    read_visible: torch.Tensor  # [T, N] row w visible to the token
    read_count: torch.Tensor  # [T, 1] rows visible to the token: (p + 1) // m


@dataclass
class AttentionMeta:
    token_slots: dict[str, torch.Tensor]  # [T] per per-token group
    window_slots: torch.Tensor  # [T, W]
    window_visible: torch.Tensor  # [T, W]
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]  # "main" / "compress" cos, sin at token positions
    csa: CompressedMeta | None
    hca: CompressedMeta | None


def build_meta(
    batch: ForwardBatch,
    window: int,
    rates: dict[str, int],
    rotary: dict[str, Rotary],
    dtype: torch.dtype,
) -> AttentionMeta:
    top = max(batch.host_layout().ends, default=1) - 1  # positions are < their request's end
    csa = hca = None
    if CSA_ROWS in batch.block_tables:
        csa = _compressed(batch, rates["csa"], CSA_STATE, CSA_ROWS, True, rotary["compress"], dtype)
    if HCA_ROWS in batch.block_tables:
        hca = _compressed(batch, rates["hca"], HCA_STATE, HCA_ROWS, False, rotary["compress"], dtype)
    return _with_window(batch, window, rotary, dtype, top, csa, hca)


def decode_meta(
    batch: ForwardBatch,
    rows: dict[str, torch.Tensor],
    max_position: int,
    window: int,
    rates: dict[str, int],
    rotary: dict[str, Rotary],
    dtype: torch.dtype,
) -> AttentionMeta:
    """:func:`build_meta` of a padded pure-decode batch (token i is request i's only one) from device
    tensors alone, so that it runs inside a compiled step: no host layout, no data-dependent shape.

    ``rows[name]`` is ``arange(N)`` of the branch's row reads (N >= what any request sees; the rest are
    never visible); every request gets one window entry per branch, pooled into slot 0 (the null block)
    unless its token completes the window. ``max_position`` bounds every position (rope table lookup).
    """
    rope = (rotary["compress"], dtype, max_position)
    csa = hca = None
    if CSA_ROWS in batch.block_tables:
        csa = _decode_compressed(batch, rates["csa"], (CSA_STATE, CSA_ROWS), True, rows["csa"], rope)
    if HCA_ROWS in batch.block_tables:
        hca = _decode_compressed(batch, rates["hca"], (HCA_STATE, HCA_ROWS), False, rows["hca"], rope)
    return _with_window(batch, window, rotary, dtype, max_position, csa, hca)


def _with_window(
    batch: ForwardBatch,
    window: int,
    rotary: dict[str, Rotary],
    dtype: torch.dtype,
    top: int,
    csa: CompressedMeta | None,
    hca: CompressedMeta | None,
) -> AttentionMeta:
    """The per-token slots, the raw window and rope (positions <= ``top``) around the compressed branches."""
    pos = batch.positions
    key_pos = pos[:, None] - (window - 1) + torch.arange(window, device=pos.device)  # [T, W]; last: pos
    groups = [g for g in (WINDOW_KV, CSA_STATE, HCA_STATE) if g in batch.block_tables]
    slots = batch.slots(groups, 1, key_pos, batch.req_indices[:, None])  # [G, T, W]
    token_slots = dict(zip(groups, slots[:, :, -1].contiguous().unbind(0), strict=True))
    rope = {name: r.cos_sin(pos, dtype, top) for name, r in rotary.items()}
    return AttentionMeta(token_slots, slots[0], key_pos >= 0, rope, csa, hca)


def _decode_compressed(
    batch: ForwardBatch,
    m: int,
    groups: tuple[str, str],
    overlap: bool,
    row_ids: torch.Tensor,
    rope: tuple[Rotary, torch.dtype, int],
) -> CompressedMeta:
    """One branch of :func:`decode_meta`; ``rope``: the compressed rows' table, dtype and position bound."""
    pos = batch.positions
    w, keep = pos // m, (pos + 1) % m == 0
    src_slots, src_valid, slots = _pooled_rows(batch, m, groups, overlap, w, batch.req_indices, keep)
    rotary, dtype, top = rope
    new_rows = NewRows(None, src_slots, src_valid, w * m, rotary.cos_sin(w * m, dtype, top), slots)
    return _reads(batch, m, groups[1], row_ids, new_rows)


def _pooled_rows(
    batch: ForwardBatch,
    m: int,
    groups: tuple[str, str],
    overlap: bool,
    w: torch.Tensor,
    req: torch.Tensor,
    keep: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(state-group slots of window ``w``'s per-token inputs, their validity, its row's slot) for each
    entry of request ``req``; entries whose ``keep`` is 0 read the null block and write slot 0."""
    state, rows = groups
    span = 2 * m if overlap else m
    src_pos = ((w - 1) if overlap else w)[:, None] * m + torch.arange(span, device=w.device)
    src_slots, slots = batch.slots(state, 1, src_pos, req[:, None]), batch.slots(rows, m, w, req)
    if keep is not None:
        src_slots, slots = src_slots * keep[:, None], slots * keep
    return src_slots, src_pos >= 0, slots


def _reads(
    batch: ForwardBatch, m: int, rows: str, row_ids: torch.Tensor, new_rows: NewRows | None
) -> CompressedMeta:
    """Each token's reads of rows ``row_ids`` of its request, visible below its count (p + 1) // m."""
    read_slots = batch.slots(rows, m, row_ids[None], batch.req_indices[:, None])  # [T, N]
    count = ((batch.positions + 1) // m)[:, None]
    return CompressedMeta(m, new_rows, read_slots, row_ids[None] < count, count)


def completed_windows(layout: BatchLayout, m: int) -> tuple[list[int], list[int], int]:
    """(window numbers, request rows, count) of the windows the step completes, in batch order.

    Request r completes windows ``[start // m, end // m)``: at most ceil(n / m) for n tokens. With
    ``layout.pad_windows`` the lists are padded to that bound with window 0 of request 0.
    """
    windows: list[int] = []
    reqs: list[int] = []
    size = 0
    for r, (start, end) in enumerate(zip(layout.starts, layout.ends, strict=True)):
        done = range(start // m, end // m)
        windows += done
        reqs += [r] * len(done)
        size += -(-(end - start) // m)
    pad = size - len(windows) if layout.pad_windows else 0
    return windows + [0] * pad, reqs + [0] * pad, len(windows)


def visible_rows(layout: BatchLayout, m: int) -> int:
    """N: the most compressed rows any token of the step sees (its request's last token's count)."""
    spans = zip(layout.starts, layout.ends, strict=True)
    return max((end // m for start, end in spans if end > start), default=0)


def _compressed(
    batch: ForwardBatch, m: int, state: str, rows: str, overlap: bool, rope: Rotary, dtype: torch.dtype
) -> CompressedMeta:
    new_rows = _new_rows(batch, m, state, rows, overlap, rope, dtype)
    row_ids = torch.arange(visible_rows(batch.host_layout(), m), device=batch.positions.device)
    return _reads(batch, m, rows, row_ids, new_rows)


def _new_rows(
    batch: ForwardBatch, m: int, state: str, rows: str, overlap: bool, rope: Rotary, dtype: torch.dtype
) -> NewRows | None:
    layout = batch.host_layout()
    windows, reqs, count = completed_windows(layout, m)
    nw = len(windows)
    if nw == 0:
        return None
    dev = batch.positions.device
    host = host_tensor(windows + reqs + [1] * count + [0] * (nw - count))
    w, req, keep = host.to(dev).view(3, nw).unbind(0)
    # padding reads the null block's zero rows and writes slot 0 (the null block)
    pad = keep if layout.pad_windows else None
    src_slots, src_valid, slots = _pooled_rows(batch, m, (state, rows), overlap, w, req, pad)
    positions = w * m
    cos_sin = rope.cos_sin(positions, dtype, max(windows) * m)
    return NewRows(count, src_slots, src_valid, positions, cos_sin, slots)
