"""MTP speculative decoding: batched verify -> accept -> rollback by block table -> MTP drafts, in one step.

A step computes, for every running request, its last token and its pending drafts (plus any prefill
chunks) in one trunk forward; the rejection sampler keeps the accepted drafts and adds one token. The
engine then commits those tokens and truncates each request's block tables to what was verified, so no
window row, compressor input, compressed row or indexer key built from a rejected token is ever read
(each is rewritten by the forward that next computes its position, before anything reads it).

Then the MTP layer's window KV is written at every position the step verified, drafting or not: row t
of the draft group (``ModelInfo.draft_group``) comes from the trunk's streams at t and the token t+1.
Positions no draft starts from write only that row (no attention, MoE or head); a drafting request's
last verified position runs the whole layer, its output giving draft 1. Where the draft graph runs the
layer, the window-only rows are written in the same graph, first (a CPU's small GEMMs can cost in
proportion to their rows: every further whole row cost about as much as the first). For
k > 1 the same layer runs again on its own output and draft, one position further, so drafts j >= 2
write speculative MTP rows past the verified end, which the next step rewrites. Published
(prefix-cached) blocks hold verified rows only.

When load control picks a plain step (engine/spec_decode/control.py), the step is the plain engine's: no
streams kept, the plain sampler, no MTP work. Its positions' window rows stay unwritten
(``KvCacheCoordinator.mark_unwritten``: never published, never read): a request drafts again only once
its next drafting forward would read none of them, the rows after them having been written by
speculative steps that drafted nothing for it (``window_ready``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridserve.cache.coordinator import KvCacheCoordinator
from hybridserve.cache.pool_set import BlockPoolSet
from hybridserve.cache.spec import GroupKind
from hybridserve.engine.core.scheduler import ScheduledRequest, SchedulerOutput
from hybridserve.engine.request import Request
from hybridserve.engine.sample.rejection_sampler import RejectionSampler, Verified
from hybridserve.engine.spec_decode.control import DraftController
from hybridserve.engine.worker.batch import block_table_tensors
from hybridserve.engine.worker.decode_graphs import DraftRows
from hybridserve.engine.worker.model_runner import ModelRunner
from hybridserve.layers.forward_batch import BatchLayout, ForwardBatch, host_tensor
from hybridserve.models.interface import PagedModel


@dataclass
class SpecDecodeStats:
    """vLLM's spec-decode counters: drafts verified, draft tokens, accepted tokens, and per position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    num_plain_steps: int = 0  # steps load control ran without the drafter

    def observe(self, verified: Verified) -> None:
        if not verified.num_drafts:
            return
        self.num_drafts += 1
        self.num_draft_tokens += verified.num_drafts
        self.num_accepted_tokens += verified.num_accepted
        for i in range(verified.num_accepted):
            self.accepted_per_pos[i] += 1


class SpecDecoder:
    """Runs a speculative step's trunk forward and verification, then the MTP layer's drafts."""

    def __init__(
        self,
        model: PagedModel[Any],
        pools: BlockPoolSet,
        coordinator: KvCacheCoordinator,
        runner: ModelRunner,
        device: torch.device,
        num_speculative_tokens: int,
        control: DraftController | None = None,
    ) -> None:
        """``runner``: its sampler and its forward (graphs, ``steps_by_path``)."""
        group = model.info.draft_group
        assert model.info.num_draft_layers > 0 and group is not None, "refused at start-up (check_features)"
        self.model, self.cache, self.coordinator, self.device = model, pools.tensors(), coordinator, device
        self.runner = runner
        self.draft_group: str = group
        spec = next(g.spec for g in coordinator.plan.groups if g.spec.name == group)
        # the rows before a position that its attention reads (None: every row, a history group)
        self.window_tokens = spec.window_tokens if spec.kind is GroupKind.WINDOW else None
        self.k = num_speculative_tokens
        self.control = control or DraftController(num_speculative_tokens, adaptive=False)
        self.rejection = RejectionSampler(runner.sampler)
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * num_speculative_tokens)
        self._streams: torch.Tensor | None = None  # the trunk's streams of the current step
        self.trunk_seconds = 0.0  # the last step's trunk forward and verification (``execute``)
        self.draft_seconds = 0.0  # the last step's MTP work (``propose``)
        self.num_drafting = 0  # requests the last ``propose`` drafted for

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, plain: bool = False, keep_streams: bool = True) -> list[Verified]:
        """Trunk forward over every scheduled token (``ModelRunner.forward``: a decode step or one that
        verifies up to k drafts per request may take a decode graph, others the prefill graph); one
        Verified per scheduled request that samples. ``plain``: a step with no drafts to verify, sampled
        by the plain sampler (its streams kept only if ``keep_streams``, for ``propose``)."""
        start, self.trunk_seconds, self.draft_seconds, self.num_drafting = time.perf_counter(), 0.0, 0.0, 0
        logits, self._streams = self.runner.forward(out.scheduled, keep_streams=keep_streams)
        sampling = [s for s in out.scheduled if s.samples]
        verified: list[Verified] = []
        if sampling and plain:
            assert not any(s.num_spec for s in sampling)
            self.stats.num_plain_steps += 1
            results = self.runner.sampler(logits, [s.request for s in sampling])
            verified = [Verified([r], 0) for r in results]
        elif sampling:
            requests = [s.request for s in sampling]
            verified = self.rejection.verify(logits, requests, [s.num_spec for s in sampling])
        self.trunk_seconds = time.perf_counter() - start
        for v in verified:
            self.stats.observe(v)
            if v.num_drafts:
                self.control.record_verified(v.num_drafts, v.num_accepted)
        return verified

    def num_drafts(self, req: Request, max_request_tokens: int, num_running: int, budget: int) -> int:
        """How many tokens to draft for ``req``'s next step: none past max_tokens or the context limit,
        and fewer when every running request's drafts would not fit the step's token budget."""
        if not self.window_ready(req):
            return 0
        room = min(req.max_tokens - len(req.output_token_ids), max_request_tokens - req.num_tokens) - 1
        under_load = max(0, budget // max(num_running, 1) - 1)
        return max(0, min(self.k, room, under_load))

    def window_ready(self, req: Request) -> bool:
        """Whether drafting from ``req``'s verified end would read only written MTP window rows: the
        layer runs its last k + 1 positions, each seeing ``window_tokens`` rows before it (a drafter that
        sees every row never drafts again once a row was left unwritten)."""
        if not self.coordinator.has_request(req.request_id):
            return True  # not admitted yet: its prompt's forward writes the rows
        a, b = self.coordinator.unwritten(req.request_id, self.draft_group)
        if a == b:
            return True
        if self.window_tokens is None:
            return False
        return req.num_computed_tokens - self.k - 1 - self.window_tokens >= b

    def leave_windows(self, scheduled: list[ScheduledRequest]) -> None:
        """A plain step: the MTP window rows of its positions stay unwritten."""
        self._streams = None
        for s in scheduled:
            req = s.request
            self.coordinator.mark_unwritten(req.request_id, self.draft_group, s.start, s.end)
            req.drop_drafts()

    def propose(self, scheduled: list[ScheduledRequest], drafts: list[int]) -> None:
        """The MTP layer's window KV at every position the step verified (``num_computed_tokens`` already
        committed), then up to ``drafts[i]`` new drafts for request i (0: only its window KV); timed."""
        start = time.perf_counter()
        self._propose(scheduled, drafts)
        self.draft_seconds = time.perf_counter() - start

    @torch.inference_mode()
    def _propose(self, scheduled: list[ScheduledRequest], drafts: list[int]) -> None:
        assert self._streams is not None
        streams, self._streams = self._streams, None
        requests = [s.request for s in scheduled]
        drafts = [self._chain_room(r, n) for r, n in zip(requests, drafts, strict=True)]
        self.num_drafting = sum(1 for n in drafts if n)
        # A drafting request's last verified position runs through the whole layer; every other verified
        # position writes its row only (before: the whole layer reads them), so a step that drafts
        # nothing (load control) still leaves the window whole for later drafts.
        kv, full = _Span(), _Span()
        offset = 0
        for s, n in zip(scheduled, drafts, strict=True):
            req, end = s.request, s.request.num_computed_tokens
            tail = min(end - s.start, 1) if n else 0
            kv.add(req, offset, s.start, end - tail)
            full.add(req, offset + end - tail - s.start, end - tail, end)
            offset += s.num_tokens
            req.drop_drafts()
        kv_rows = streams[kv.rows_tensor(self.device)] if kv.requests else None
        in_graph = bool(full.requests) and len(kv.rows) <= self.runner.max_draft_rows
        if kv_rows is not None and not in_graph:  # a prompt's rows, or nothing drafts
            self.model.mtp_write_kv(kv_rows, self._batch(*kv.batch()), self.cache)
        if full.requests:
            window_only = None if kv_rows is None or not in_graph else (kv_rows, kv)
            out, logits = self._mtp(streams[full.rows_tensor(self.device)], *full.batch(), window_only)
            last = torch.tensor(full.last_rows(), device=self.device)
            active = [n for n in drafts if n]
            assert len(active) == len(full.requests)
            self._draft_chain(full.requests, out[last], None if logits is None else logits[last], active)

    def _mtp(
        self,
        streams: torch.Tensor,
        requests: list[Request],
        ids: list[int],
        starts: list[int],
        ends: list[int],
        window_only: tuple[torch.Tensor, _Span] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The MTP layer over positions [starts[i], ends[i]) of request i (``streams`` there, ``ids`` the
        tokens after them) -> its streams, and their draft logits where the draft graph ran it (else None:
        the caller computes those it needs). ``window_only``: (streams, span) of positions that first
        write only their window row."""
        kv = None
        if window_only is not None:
            rows, span = window_only
            kv = DraftRows(rows, span.ids, *self._rows(span.requests, span.starts, span.ends))
        drafted = self.runner.draft(DraftRows(streams, ids, *self._rows(requests, starts, ends)), kv)
        if drafted is not None:
            logits, out = drafted
            return out, logits
        if window_only is not None:
            self.model.mtp_write_kv(window_only[0], self._batch(*window_only[1].batch()), self.cache)
        return self.model.mtp_forward(streams, self._batch(requests, ids, starts, ends), self.cache), None

    def _rows(
        self, requests: list[Request], starts: list[int], ends: list[int]
    ) -> tuple[list[int], list[dict[str, list[int]]]]:
        """Each position of request i's [starts[i], ends[i]) and its request's block tables."""
        positions: list[int] = []
        tables: list[dict[str, list[int]]] = []
        for req, start, end in zip(requests, starts, ends, strict=True):
            positions += range(start, end)
            tables += [self.coordinator.block_tables(req.request_id)] * (end - start)
        return positions, tables

    def _draft_chain(
        self, requests: list[Request], prev: torch.Tensor, logits: torch.Tensor | None, drafts: list[int]
    ) -> None:
        """Draft 1 from ``prev``, the MTP layer's output at each request's last verified position (and its
        draft logits, if computed); draft j + 1 from the layer run again on draft j and its own output, one
        position further."""
        active = list(range(len(requests)))
        self._sample_drafts(requests, prev, logits)
        for depth in range(1, self.k):
            keep = [j for j, i in enumerate(active) if drafts[i] > depth]
            if not keep:
                return
            if len(keep) < len(active):
                active, prev = [active[j] for j in keep], prev[torch.tensor(keep, device=self.device)]
            reqs = [requests[i] for i in active]
            ids = [r.spec_token_ids[-1] for r in reqs]
            at = [r.num_computed_tokens + depth - 1 for r in reqs]
            prev, logits = self._mtp(prev, reqs, ids, at, [p + 1 for p in at])
            if logits is not None:  # views of the draft graph's buffers, which its next run rewrites
                prev, logits = prev.clone(), logits.clone()
            self._sample_drafts(reqs, prev, logits)

    def _chain_room(self, req: Request, n: int) -> int:
        """Drafts 2..n write MTP rows at positions c..c+n-2: take their blocks now, or draft just one."""
        if n < 2:
            return n
        c = req.num_computed_tokens
        return n if self.coordinator.allocate(req.request_id, c, c + n - 1) else 1

    def _sample_drafts(
        self, requests: list[Request], streams: torch.Tensor, logits: torch.Tensor | None
    ) -> None:
        if logits is None:
            logits = self.model.mtp_logits(streams)
        tokens, probs = self.rejection.draft(logits, requests)
        for i, (req, tok) in enumerate(zip(requests, tokens, strict=True)):
            req.spec_token_ids.append(tok)
            if not req.params.greedy and probs is not None:
                row = probs[i : i + 1]
                req.spec_probs = row if req.spec_probs is None else torch.cat([req.spec_probs, row])

    def _batch(
        self, requests: list[Request], ids: list[int], starts: list[int], ends: list[int]
    ) -> ForwardBatch:
        """A batch over the draft group only: request i computes positions [starts[i], ends[i])."""
        positions: list[int] = []
        req_rows: list[int] = []
        for r, (start, end) in enumerate(zip(starts, ends, strict=True)):
            positions += range(start, end)
            req_rows += [r] * (end - start)
        host = host_tensor(ids + positions + req_rows + ends).to(self.device)
        input_ids, pos, rows, seq_ends = host.split([len(ids)] * 3 + [len(ends)])
        group = self.draft_group
        tables = [{group: self.coordinator.block_tables(r.request_id)[group]} for r in requests]
        return ForwardBatch(
            input_ids=input_ids,
            positions=pos,
            req_indices=rows,
            seq_ends=seq_ends,
            block_tables=block_table_tensors(tables, self.device),
            block_tokens=self.coordinator.block_tokens,
            logits_indices=input_ids.new_zeros(0),
            layout=BatchLayout(tuple(starts), tuple(ends)),
        )


@dataclass
class _Span:
    """Positions [start, end) of some requests, one MTP batch: their rows in the step's streams and the
    next token of each (the MTP layer at t reads the trunk's streams at t and the token t + 1)."""

    requests: list[Request] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)

    def add(self, req: Request, row: int, start: int, end: int) -> None:
        if end <= start:
            return
        self.requests.append(req)
        self.rows += range(row, row + end - start)
        self.ids += req.all_token_ids[start + 1 : end + 1]
        self.starts.append(start)
        self.ends.append(end)

    def rows_tensor(self, device: torch.device) -> torch.Tensor:
        return host_tensor(self.rows).to(device)

    def batch(self) -> tuple[list[Request], list[int], list[int], list[int]]:
        return self.requests, self.ids, self.starts, self.ends

    def last_rows(self) -> list[int]:
        """Each request's last position, as a row of this batch."""
        out, at = [], 0
        for start, end in zip(self.starts, self.ends, strict=True):
            at += end - start
            out.append(at - 1)
        return out
