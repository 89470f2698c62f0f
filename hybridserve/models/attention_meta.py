"""Per-step attention metadata for DeepSeek-V4: every slot a layer reads or writes, computed once.

Rows of a compressed group (stride m) are numbered by window: row w holds tokens [w*m, (w+1)*m)
(CSA row w also reads the first half of window w-1). A query at position p sees rows
w < (p + 1) // m and raw tokens (p - W, p].

Queries are read in blocks of Q consecutive tokens of one request (``QueryBlocks``): a block reads its
Q + W - 1 window rows and its request's compressed rows once, masked per query (the reference's dense
form), instead of gathering W rows for every query. Q is chosen per step (:func:`query_block_size`);
a decode step gets Q = 1, which is the per-query form.

A mixed step reads its one-token requests (decodes) apart, as a decode step does (Q = 1), and gives its
query blocks to the others' chunks (``AttentionMeta.split``): a decode padded to a block of Q would read
Q + W - 1 window rows for one query. A compiled step (``interface.MetaShapes``: padded windows, the query
rows always as an index) always comes in that form, so that one graph serves steps with and without
decodes: where it has fewer than two decodes, filler entries (up to ``MIN_DECODE_ROWS``) repeat its
first main token's reads (the attention writes the decodes' outputs first and the main group's over
them).

Every shape follows from the batch's host-side layout (Python ints), never from reading a device
tensor. With ``BatchLayout.pad_windows`` a decode batch of R requests always gets the same shapes but
for N (the compressed rows it reads) and the block-table width, which grow with the context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridserve.layers.forward_batch import BatchLayout, ForwardBatch, host_tensor
from hybridserve.layers.rope import Rotary
from hybridserve.models.interface import MetaShapes

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
    completes: torch.Tensor | None = None  # decode_meta's HCA branch: whether any entry completes a window


@dataclass
class CompressedMeta:
    """Where one compressed branch (CSA or HCA) writes new rows and which rows each query reads."""

    rate: int
    new_rows: NewRows | None  # None: the step completes no window
    read_slots: torch.Tensor  # [B, N] slots of rows 0..N-1 of each query block's request
    read_visible: torch.Tensor  # [B, Q, N] row w visible to the block's query
    read_count: torch.Tensor  # [B * Q, 1] rows visible to each padded query: (p + 1) // m, 0 for padding


@dataclass
class QueryBlocks:
    """The step's queries in B blocks of ``size`` consecutive tokens of one request; the padded rows
    [B * size] hold block b's queries at b * size + i, the rest are padding (they see nothing)."""

    size: int
    token_rows: torch.Tensor | None  # [T] padded row of each token; None: the identity (no padding)
    padded: int | None  # B * size when ``token_rows`` is set

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """Token rows [T, ...] -> padded rows [B * size, ...] (zeros in the padding)."""
        if self.token_rows is None:
            return x
        assert self.padded is not None
        return x.new_zeros(self.padded, *x.shape[1:]).index_copy_(0, self.token_rows, x)

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.token_rows is None else x.index_select(0, self.token_rows)


@dataclass
class AttentionMeta:
    """The step's writes (``token_slots``, ``rope``, each branch's ``new_rows``) and its queries' reads:
    with ``split`` set, ``blocks``, the window and the branches' reads cover only ``split.main_rows``."""

    token_slots: dict[str, torch.Tensor]  # [T] per per-token group
    blocks: QueryBlocks
    window_slots: torch.Tensor  # [B, Q + W - 1] window rows of each query block
    window_visible: torch.Tensor  # [B, Q, Q + W - 1]
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]  # "main" / "compress" cos, sin at token positions
    csa: CompressedMeta | None
    hca: CompressedMeta | None
    split: SplitReads | None = None


@dataclass
class SplitReads:
    """A mixed step's reads in two groups: the multi-token requests' tokens (``main_rows``, in query blocks
    of the step's Q) and the one-token requests' (``decode_rows``, one query a block). ``decode`` holds
    the decode group's reads (its ``token_slots`` empty, its branches without ``new_rows``, the step's
    ``rope``). The first ``decodes`` decode entries are real; the rest (a compiled step's filler) repeat
    the first main token's row and reads."""

    main_rows: torch.Tensor  # [Tm] step rows of the main group, in order
    decode_rows: torch.Tensor  # [Td]
    decode: AttentionMeta
    decodes: int


@dataclass
class _Blocks:
    """Device side of the query blocks: each block's request row, first position and valid queries."""

    public: QueryBlocks
    req: torch.Tensor  # [B]
    start: torch.Tensor  # [B]
    valid: torch.Tensor | None  # [B, Q] query i of the block is a token; None: all are (Q = 1)

    def positions(self) -> torch.Tensor:
        """[B, Q] position of every padded query (padding: past its request's end)."""
        size = self.public.size
        return self.start[:, None] + torch.arange(size, device=self.start.device)


def build_meta(
    batch: ForwardBatch,
    window: int,
    rates: dict[str, int],
    rotary: dict[str, Rotary],
    dtype: torch.dtype,
    shapes: MetaShapes | None = None,
) -> AttentionMeta:
    """``shapes``: the uniform form a compiled graph takes (see :class:`MetaShapes`)."""
    layout = batch.host_layout()
    top = max(layout.ends, default=1) - 1  # positions are < their request's end
    sizes = _BLOCK_SIZES if shapes is None else shapes.block_sizes
    main, decodes, size = split_requests(layout, window, sizes)
    fill = 0 if shapes is None else MIN_DECODE_ROWS  # a compiled step always splits (one graph)
    requests = None if not (decodes or fill) else main
    blocks = _host_blocks(batch, size, always_index=shapes is not None, requests=requests)
    rope = (rotary["compress"], dtype)
    csa = hca = None
    if CSA_ROWS in batch.block_tables:
        reads = None if shapes is None else shapes.rows["csa"]
        csa = _compressed(batch, blocks, rates["csa"], (CSA_STATE, CSA_ROWS), True, rope, reads)
    if HCA_ROWS in batch.block_tables:
        reads = None if shapes is None else shapes.rows["hca"]
        hca = _compressed(batch, blocks, rates["hca"], (HCA_STATE, HCA_ROWS), False, rope, reads)
    meta = _with_window(batch, blocks, window, rotary, dtype, top, csa, hca)
    if decodes or fill:
        meta.split = _split_reads(batch, meta, main, decodes, window, fill)
    return meta


def split_requests(
    layout: BatchLayout, window: int, sizes: tuple[int, ...]
) -> tuple[list[int], list[int], int]:
    """(multi-token requests, one-token requests, the first group's query block size) of a step whose
    decodes are read apart: at least two decodes (one would be a dim of 1 in a compiled step),
    ``SPLIT_MIN_TOKENS`` others in query blocks of more than one token; else (every request, [], Q)."""
    counts = [end - start for start, end in zip(layout.starts, layout.ends, strict=True)]
    decodes = [r for r, n in enumerate(counts) if n == 1]
    main = [r for r, n in enumerate(counts) if n > 1]
    if len(decodes) >= 2 and sum(counts[r] for r in main) >= SPLIT_MIN_TOKENS:
        size = query_block_size(layout, window, sizes, main)
        if size > 1:
            return main, decodes, size
    return list(range(len(counts))), [], query_block_size(layout, window, sizes)


def _split_reads(
    batch: ForwardBatch, meta: AttentionMeta, main: list[int], decodes: list[int], window: int, fill: int
) -> SplitReads:
    """The decode group's reads (one query a block), beside ``meta``'s for the main group; filler entries
    (the first main token's) up to ``fill`` entries."""
    layout = batch.host_layout()
    first = [0]
    for start, end in zip(layout.starts, layout.ends, strict=True):
        first.append(first[-1] + end - start)
    main_rows = [t for r in main for t in range(first[r], first[r + 1])]
    reqs = decodes + [main[0]] * max(fill - len(decodes), 0)
    n, dev = len(reqs), batch.positions.device
    host = host_tensor(main_rows + [first[r] for r in reqs] + reqs + [layout.starts[r] for r in reqs]).to(dev)
    main_t, rows_t, req_t, start_t = host.split([len(main_rows), n, n, n])
    blocks = _Blocks(QueryBlocks(1, None, None), req_t, start_t, None)
    csa = hca = None
    if meta.csa is not None:
        csa = _reads(batch, blocks, meta.csa.rate, CSA_ROWS, _row_ids(meta.csa), None)
    if meta.hca is not None:
        hca = _reads(batch, blocks, meta.hca.rate, HCA_ROWS, _row_ids(meta.hca), None)
    window_slots, visible = _window_reads(batch, blocks, window)
    decode = AttentionMeta({}, blocks.public, window_slots, visible, meta.rope, csa, hca)
    return SplitReads(main_t, rows_t, decode, len(decodes))


def _row_ids(branch: CompressedMeta) -> torch.Tensor:
    n = branch.read_slots.shape[1]
    return torch.arange(n, device=branch.read_slots.device)


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
    blocks = _Blocks(QueryBlocks(1, None, None), batch.req_indices, batch.positions, None)
    rope = (rotary["compress"], dtype, max_position)
    csa = hca = None
    if CSA_ROWS in batch.block_tables:
        csa = _decode_compressed(batch, blocks, rates["csa"], (CSA_STATE, CSA_ROWS), True, rows["csa"], rope)
    if HCA_ROWS in batch.block_tables:
        hca = _decode_compressed(batch, blocks, rates["hca"], (HCA_STATE, HCA_ROWS), False, rows["hca"], rope)
    return _with_window(batch, blocks, window, rotary, dtype, max_position, csa, hca)


# The fewest tokens of multi-token requests for which a step reads its decodes apart: a step of few
# tokens gains little (a compiled one keeps every request in its main group, beside filler decodes).
SPLIT_MIN_TOKENS = 16
# A compiled step's decode group has at least this many entries (a dim of 1 would be specialised).
MIN_DECODE_ROWS = 2
# Candidate query-block sizes, and the cost of gathering a key row relative to scoring it for one query.
_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64)
_GATHER_COST = 4.0


def query_block_size(
    layout: BatchLayout, window: int, sizes: tuple[int, ...] = _BLOCK_SIZES, requests: list[int] | None = None
) -> int:
    """The Q of ``sizes`` that minimises padded queries x rows each reads x (1 + gather cost / Q) over
    ``requests`` (None: all): 1 for a decode step, 8-32 for prefill chunks."""
    counts = [end - start for start, end in zip(layout.starts, layout.ends, strict=True)]
    if requests is not None:
        counts = [counts[r] for r in requests]

    def cost(q: int) -> float:
        padded = sum(-(-n // q) * q for n in counts)
        return padded * (q + window - 1) * (1 + _GATHER_COST / q)

    return min(sizes, key=cost)


def _host_blocks(
    batch: ForwardBatch, size: int, always_index: bool = False, requests: list[int] | None = None
) -> _Blocks:
    """Blocks of ``size`` consecutive tokens of each of ``requests`` (None: every request), from the host
    layout; the padded rows number those requests' tokens in order. ``always_index``: the padded query
    rows as an index even where they are the token rows, and at least 2 blocks (a lone request's chunk of
    up to ``size`` tokens, e.g. one verifying drafts, gets a second block that repeats its first one's
    reads with no valid query)."""
    if size == 1 and requests is None:
        return _Blocks(QueryBlocks(1, None, None), batch.req_indices, batch.positions, None)
    layout = batch.host_layout()
    req: list[int] = []
    start: list[int] = []
    end: list[int] = []
    rows: list[int] = []
    for r in range(len(layout.starts)) if requests is None else requests:
        s, e = layout.starts[r], layout.ends[r]
        rows += range(len(req) * size, len(req) * size + e - s)
        first = range(s, e, size)
        req += [r] * len(first)
        start += first
        end += [e] * len(first)
    if always_index and len(req) == 1:
        req, start, end = req * 2, start * 2, end + start  # the second block ends where it starts
    nb = len(req)
    host = host_tensor(req + start + end + rows).to(batch.positions.device)
    req_t, start_t, end_t = host[: 3 * nb].view(3, nb).unbind(0)
    valid = start_t[:, None] + torch.arange(size, device=start_t.device) < end_t[:, None]
    if len(rows) == nb * size and not always_index:  # every block full: the padded rows are the token rows
        return _Blocks(QueryBlocks(size, None, None), req_t, start_t, valid)
    return _Blocks(QueryBlocks(size, host[3 * nb :], nb * size), req_t, start_t, valid)


def _with_window(
    batch: ForwardBatch,
    blocks: _Blocks,
    window: int,
    rotary: dict[str, Rotary],
    dtype: torch.dtype,
    top: int,
    csa: CompressedMeta | None,
    hca: CompressedMeta | None,
) -> AttentionMeta:
    """The per-token slots, the blocks' raw window and rope (positions <= ``top``) around the compressed
    branches. Block key j is position start - (W - 1) + j; query i sees keys i..i + W - 1 (>= 0)."""
    pos = batch.positions
    groups = [g for g in (WINDOW_KV, CSA_STATE, HCA_STATE) if g in batch.block_tables]
    token_slots = dict(zip(groups, batch.slots(groups, 1, pos, batch.req_indices).unbind(0), strict=True))
    window_slots, visible = _window_reads(batch, blocks, window)
    rope = {name: r.cos_sin(pos, dtype, top) for name, r in rotary.items()}
    return AttentionMeta(token_slots, blocks.public, window_slots, visible, rope, csa, hca)


def _window_reads(batch: ForwardBatch, blocks: _Blocks, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(window rows [B, Q + W - 1] of each block, visible [B, Q, Q + W - 1])."""
    q, dev = blocks.public.size, batch.positions.device
    span = torch.arange(q + window - 1, device=dev)
    key_pos = blocks.start[:, None] - (window - 1) + span  # [B, Q + W - 1]
    window_slots = batch.slots(WINDOW_KV, 1, key_pos, blocks.req[:, None])
    visible = (key_pos >= 0)[:, None, :]
    if q > 1:
        offset = span[None, :] - torch.arange(q, device=dev)[:, None]  # [Q, Q + W - 1]
        assert blocks.valid is not None
        visible = visible & ((offset >= 0) & (offset < window))[None] & blocks.valid[:, :, None]
    return window_slots, visible


def _decode_compressed(
    batch: ForwardBatch,
    blocks: _Blocks,
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
    cos_sin = rotary.cos_sin(w * m, dtype, top)
    completes = None if overlap else keep.any()  # HCA: a window completes once in m tokens a request
    new_rows = NewRows(None, src_slots, src_valid, w * m, cos_sin, slots, completes)
    return _reads(batch, blocks, m, groups[1], row_ids, new_rows)


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
    batch: ForwardBatch, blocks: _Blocks, m: int, rows: str, row_ids: torch.Tensor, new_rows: NewRows | None
) -> CompressedMeta:
    """Each block's reads of rows ``row_ids`` of its request; a query sees those below (p + 1) // m."""
    read_slots = batch.slots(rows, m, row_ids[None], blocks.req[:, None])  # [B, N]
    count = (blocks.positions() + 1) // m  # [B, Q]
    if blocks.valid is not None:
        count = count * blocks.valid
    visible = row_ids[None, None] < count[..., None]
    return CompressedMeta(m, new_rows, read_slots, visible, count.view(-1, 1))


def completed_windows(layout: BatchLayout, m: int) -> tuple[list[int], list[int], int]:
    """(window numbers, request rows, count) of the windows the step completes, in batch order.

    Request r completes windows ``[start // m, end // m)``: at most ceil(n / m) for n tokens. With
    ``layout.pad_windows`` the lists are padded to that bound (at least 2) with window 0 of request 0.
    """
    windows: list[int] = []
    reqs: list[int] = []
    size = 0
    for r, (start, end) in enumerate(zip(layout.starts, layout.ends, strict=True)):
        done = range(start // m, end // m)
        windows += done
        reqs += [r] * len(done)
        size += -(-(end - start) // m)
    pad = max(size, 2) - len(windows) if layout.pad_windows else 0  # never a dim of 1
    return windows + [0] * pad, reqs + [0] * pad, len(windows)


def visible_rows(layout: BatchLayout, m: int) -> int:
    """N: the most compressed rows any token of the step sees (its request's last token's count)."""
    spans = zip(layout.starts, layout.ends, strict=True)
    return max((end // m for start, end in spans if end > start), default=0)


def _compressed(
    batch: ForwardBatch,
    blocks: _Blocks,
    m: int,
    groups: tuple[str, str],
    overlap: bool,
    rope: tuple[Rotary, torch.dtype],
    reads: int | None,
) -> CompressedMeta:
    """One branch of :func:`build_meta`; ``reads``: the rows each block reads (None: what any query sees)."""
    state, rows = groups
    new_rows = _new_rows(batch, m, state, rows, overlap, *rope)
    n = visible_rows(batch.host_layout(), m) if reads is None else reads
    row_ids = torch.arange(n, device=batch.positions.device)
    return _reads(batch, blocks, m, rows, row_ids, new_rows)


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


def tie_shapes(meta: AttentionMeta, tokens: int) -> None:
    """State the sizes ``meta``'s tensors share by construction (``torch._check``), for a compiled trace:
    with every input size its own symbol, the trace otherwise proves each relation (B * Q padded rows
    against a [B, Q, ...] mask) afresh at every view, which made most of its time."""
    if meta.split is None:
        _tie_group(meta, tokens)
        return
    _tie_group(meta, meta.split.main_rows.shape[0])
    _tie_group(meta.split.decode, meta.split.decode_rows.shape[0])


def _tie_group(meta: AttentionMeta, tokens: int) -> None:
    b, q = meta.window_visible.shape[0], meta.window_visible.shape[1]
    torch._check(meta.window_slots.shape[0] == b)
    torch._check(meta.window_slots.shape[1] == meta.window_visible.shape[2])
    torch._check(meta.blocks.size == q)
    rows = meta.blocks.padded if meta.blocks.token_rows is not None else tokens
    torch._check(rows == b * q)
    for branch in (meta.csa, meta.hca):
        if branch is None:
            continue
        n = branch.read_slots.shape[1]
        torch._check(branch.read_slots.shape[0] == b)
        torch._check(branch.read_visible.shape[0] == b)
        torch._check(branch.read_visible.shape[1] == q)
        torch._check(branch.read_visible.shape[2] == n)
        torch._check(branch.read_count.shape[0] == b * q)
