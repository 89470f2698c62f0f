"""MTP speculative decoding: batched verify -> accept -> rollback by block table -> MTP drafts, in one step.

A step computes, for every running request, its last token and its pending drafts (plus any prefill
chunks) in one trunk forward; the rejection sampler keeps the accepted drafts and adds one token. The
engine then commits those tokens and truncates each request's block tables to what was verified, so no
window row, compressor input, compressed row or indexer key built from a rejected token is ever read
(each is rewritten by the forward that next computes its position, before anything reads it).

Then the MTP layer runs over every position the step verified: at position t it reads the trunk's
streams at t and the token t+1, and writes its own window KV (row t of the draft group ``mtp_kv``). Its
output at the last verified position gives draft 1; for k > 1 the same layer runs again on its own
output and draft, one position further, so drafts j >= 2 write speculative MTP rows past the verified
end, which the next step's MTP pass rewrites. Published (prefix-cached) blocks hold verified rows only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridserve.cache.coordinator import KvCacheCoordinator
from hybridserve.cache.pool import BlockPoolSet
from hybridserve.engine.batch import _block_tables, build_forward_batch
from hybridserve.engine.prompt_logprobs import gather_prompt_logprobs
from hybridserve.engine.rejection_sampler import RejectionSampler, Verified
from hybridserve.engine.request import Request
from hybridserve.engine.sampler import Sampler
from hybridserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from hybridserve.engine.spec_control import DraftController
from hybridserve.layers.forward_batch import BatchLayout, ForwardBatch, host_tensor
from hybridserve.models.attention_meta import MTP_KV
from hybridserve.models.deepseek_v4 import DeepseekV4Model


@dataclass
class SpecDecodeStats:
    """vLLM's spec-decode counters: drafts verified, draft tokens, accepted tokens, and per position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

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
        model: DeepseekV4Model,
        pools: BlockPoolSet,
        coordinator: KvCacheCoordinator,
        sampler: Sampler,
        device: torch.device,
        num_speculative_tokens: int,
        control: DraftController | None = None,
    ) -> None:
        assert len(model.mtp) > 0, "MTP speculative decoding needs a checkpoint with MTP weights"
        self.model, self.cache, self.coordinator, self.device = model, pools.tensors(), coordinator, device
        self.k = num_speculative_tokens
        self.control = control or DraftController(num_speculative_tokens, adaptive=False)
        self.rejection = RejectionSampler(sampler)
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * num_speculative_tokens)
        self._streams: torch.Tensor | None = None  # the trunk's streams of the current step

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> list[Verified]:
        """Trunk forward over every scheduled token; one Verified per scheduled request that samples."""
        batch = build_forward_batch(out.scheduled, self.coordinator, self.device)
        self._streams = self.model(batch, self.cache)
        gather_prompt_logprobs(self.model, out.scheduled, self._streams)
        sampling = [s for s in out.scheduled if s.samples]
        if not sampling:
            return []
        logits = self.model.compute_logits(self._streams[batch.logits_indices])
        verified = self.rejection.verify(
            logits, [s.request for s in sampling], [s.num_spec for s in sampling]
        )
        for v in verified:
            self.stats.observe(v)
            if v.num_drafts:
                self.control.record_verified(v.num_drafts, v.num_accepted)
        return verified

    def num_drafts(self, req: Request, max_request_tokens: int, num_running: int, budget: int) -> int:
        """How many tokens to draft for ``req``'s next step: none past max_tokens or the context limit,
        and fewer when every running request's drafts would not fit the step's token budget."""
        room = min(req.max_tokens - len(req.output_token_ids), max_request_tokens - req.num_tokens) - 1
        under_load = max(0, budget // max(num_running, 1) - 1)
        return max(0, min(self.k, room, under_load))

    @torch.inference_mode()
    def propose(self, scheduled: list[ScheduledRequest], drafts: list[int]) -> None:
        """MTP over the verified positions of every scheduled request (``num_computed_tokens`` already
        committed), then up to ``drafts[i]`` new drafts for request i (0: only its MTP window KV)."""
        assert self._streams is not None
        rows: list[int] = []
        ids: list[int] = []
        last: list[int] = []
        offset = 0
        for s in scheduled:
            req, end = s.request, s.request.num_computed_tokens
            rows += range(offset, offset + end - s.start)
            ids += req.all_token_ids[s.start + 1 : end + 1]
            last.append(len(ids) - 1)
            offset += s.num_tokens
            req.drop_drafts()
        requests = [s.request for s in scheduled]
        starts, ends = [s.start for s in scheduled], [r.num_computed_tokens for r in requests]
        streams = self.model.mtp_forward(
            self._streams[torch.tensor(rows, device=self.device)],
            self._batch(requests, ids, starts, ends),
            self.cache,
        )
        self._streams = None
        self._draft_chain(requests, streams, last, drafts)

    def _draft_chain(
        self, requests: list[Request], streams: torch.Tensor, last: list[int], drafts: list[int]
    ) -> None:
        """Draft 1 from the MTP output at each request's last verified position; draft j + 1 from the MTP
        layer run again on draft j and its own output, one position further (blocks permitting)."""
        drafts = [self._chain_room(r, n) for r, n in zip(requests, drafts, strict=True)]
        active = [i for i, n in enumerate(drafts) if n > 0]
        if not active:
            return
        prev = streams[torch.tensor([last[i] for i in active], device=self.device)]
        for depth in range(self.k):
            keep = [j for j, i in enumerate(active) if drafts[i] > depth]
            if not keep:
                return
            if len(keep) < len(active):
                active, prev = [active[j] for j in keep], prev[torch.tensor(keep, device=self.device)]
            reqs = [requests[i] for i in active]
            if depth:
                ids = [r.spec_token_ids[-1] for r in reqs]
                at = [r.num_computed_tokens + depth - 1 for r in reqs]
                batch = self._batch(reqs, ids, at, [p + 1 for p in at])
                prev = self.model.mtp_forward(prev, batch, self.cache)
            self._sample_drafts(reqs, prev)

    def _chain_room(self, req: Request, n: int) -> int:
        """Drafts 2..n write MTP rows at positions c..c+n-2: take their blocks now, or draft just one."""
        if n < 2:
            return n
        c = req.num_computed_tokens
        return n if self.coordinator.allocate(req.request_id, c, c + n - 1) else 1

    def _sample_drafts(self, requests: list[Request], streams: torch.Tensor) -> None:
        tokens, probs = self.rejection.draft(self.model.mtp_logits(streams), requests)
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
        tables = [{MTP_KV: self.coordinator.block_tables(r.request_id)[MTP_KV]} for r in requests]
        return ForwardBatch(
            input_ids=input_ids,
            positions=pos,
            req_indices=rows,
            seq_ends=seq_ends,
            block_tables=_block_tables(tables, self.device),
            block_tokens=self.coordinator.block_tokens,
            logits_indices=input_ids.new_zeros(0),
            layout=BatchLayout(tuple(starts), tuple(ends)),
        )
