"""Per-step attention metadata for DeepSeek-V4: every slot a layer reads or writes, computed once.

Rows of a compressed group (stride m) are numbered by window: row w holds tokens [w*m, (w+1)*m)
(CSA row w also reads the first half of window w-1). A query at position p sees rows
w < (p + 1) // m and raw tokens (p - W, p].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridserve.layers.forward_batch import ForwardBatch
from hybridserve.layers.rope import Rotary

WINDOW_KV = "swa_kv"
CSA_STATE = "csa_state"
HCA_STATE = "hca_state"
CSA_ROWS = "csa_rows"
HCA_ROWS = "hca_rows"


@dataclass
class CompressedMeta:
    """Where one compressed branch (CSA or HCA) writes new rows and which rows each query reads."""

    rate: int
    done: torch.Tensor  # [Nw] tokens whose arrival completes a window
    src_slots: torch.Tensor  # [Nw, span] state-group slots of the window's per-token inputs
    src_valid: torch.Tensor  # [Nw, span]
    row_positions: torch.Tensor  # [Nw] rope position of each new row (w * m)
    row_slots: torch.Tensor  # [Nw] history-group slot of each new row
    read_slots: torch.Tensor  # [T, N] slots of rows 0..N-1 of each token's request
    read_visible: torch.Tensor  # [T, N] row w visible to the token


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
    pos, req = batch.positions, batch.req_indices
    token_slots = {
        g: batch.slots(g, 1, pos, req) for g in (WINDOW_KV, CSA_STATE, HCA_STATE) if g in batch.block_tables
    }
    key_pos = pos[:, None] - (window - 1) + torch.arange(window, device=pos.device)
    window_slots = batch.slots(WINDOW_KV, 1, key_pos, req[:, None].expand_as(key_pos))
    rope = {name: r.cos_sin(pos, dtype) for name, r in rotary.items()}
    csa = hca = None
    if CSA_ROWS in batch.block_tables:
        csa = _compressed(batch, rates["csa"], CSA_STATE, CSA_ROWS, overlap=True)
    if HCA_ROWS in batch.block_tables:
        hca = _compressed(batch, rates["hca"], HCA_STATE, HCA_ROWS, overlap=False)
    return AttentionMeta(token_slots, window_slots, key_pos >= 0, rope, csa, hca)


def _compressed(batch: ForwardBatch, m: int, state: str, rows: str, overlap: bool) -> CompressedMeta:
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
    return CompressedMeta(
        rate=m,
        done=done,
        src_slots=src_slots,
        src_valid=src_pos >= 0,
        row_positions=w * m,
        row_slots=batch.slots(rows, m, w, req[done]),
        read_slots=per_req[req],
        read_visible=row_ids[None] < visible_rows[:, None],
    )
