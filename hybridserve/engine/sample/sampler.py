"""Token selection: penalties, greedy / temperature / top-k / top-p / min-p, per-request seeds, logprobs.

Any parameters that SamplingParams accepts are numerically safe here: penalties stay finite, banned or
out-of-vocabulary ids never crash, and a row with nothing left to draw from falls back to its best token.

The whole batch is handled by a fixed number of tensor ops on the logits' device; Python work per step is
proportional to the batch, never to a request's context. Penalties read a per-request token history that
the sampler keeps incrementally (see ``_TokenHistory``). Random rows draw by inverse transform sampling:
one uniform per row, from the request's own generator when it has a seed, so a seeded request's tokens do
not depend on the rest of the batch. (Before the sampler was batched, rows drew with ``torch.multinomial``:
seeded requests now draw other tokens than they did then, from the same distribution.)
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hybridserve.engine.request import Request
from hybridserve.engine.sample.ops import (
    Filters,
    SampleResult,
    banned,
    best_tokens,
    biased,
    filtered_weights,
    finite,
    in_vocab,
    penalises,
    penalty_factors,
    repetition_penalised,
    sample_results,
    to_tensor,
    uniform,
)
from hybridserve.engine.sample.structured_outputs import StructuredOutputs

_F32 = torch.finfo(torch.float32)


class Sampler:
    """Samples one token per row of ``logits`` for the matching request.

    Logprobs are those of the raw model distribution (before penalties and temperature), as vLLM
    reports by default. A request with a seed draws from its own generator, so its tokens do not
    depend on what else is in the batch; the others share the sampler's generator (one per device).
    """

    def __init__(self, seed: int = 0, structured: StructuredOutputs | None = None) -> None:
        self.seed = seed
        self.structured = structured  # grammar masks of structured-output requests
        self.generator = torch.Generator().manual_seed(seed)
        self._device_generators: dict[torch.device, torch.Generator] = {}
        self.history = _TokenHistory()

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[SampleResult]:
        logits = finite(logits.float())
        self.history.release_finished()
        # Grammar masks first, so that even the fallback of a row with every token banned obeys them.
        allowed = self.structured.apply(logits, requests) if self.structured is not None else logits
        penalised = self.penalised(allowed, requests)
        best = best_tokens(penalised, allowed)
        tokens = self._choose(penalised, best, requests)
        return sample_results(tokens, logits, requests)

    def penalised(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """The logits after min_tokens bans and penalties; ``logits`` itself when no row has either."""
        out = biased(banned(logits, requests), requests)
        rows = [i for i, r in enumerate(requests) if penalises(r.params)]
        if not rows:
            return out
        if len(rows) == len(requests):
            return self._penalise(out, requests)
        idx = to_tensor(rows, torch.long, out.device)
        return out.index_copy(0, idx, self._penalise(out.index_select(0, idx), [requests[i] for i in rows]))

    def _penalise(self, vals: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Repetition, then frequency and presence penalties, of one row per request (a new tensor)."""
        slots = self.history.slots(requests, vals.shape[1], vals.device)
        factors = to_tensor([penalty_factors(r.params) for r in requests], vals.dtype, vals.device)
        if any(r.params.repetition_penalty != 1.0 for r in requests):
            seen = self.history.all_counts.index_select(0, slots) > 0
            vals = repetition_penalised(vals, factors[:, :1], seen)
        if any(r.params.frequency_penalty or r.params.presence_penalty for r in requests):
            counts = self.history.output_counts.index_select(0, slots)
            vals = vals - (factors[:, 1:2] * counts + factors[:, 2:3] * counts.clamp(max=1))
        return vals

    def _choose(self, logits: torch.Tensor, best: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        rows = [i for i, r in enumerate(requests) if not r.params.greedy]
        if not rows:
            return best
        if len(rows) == len(requests):
            return self._draw(logits, best, requests)
        idx = to_tensor(rows, torch.long, logits.device)
        drawn = self._draw(
            logits.index_select(0, idx), best.index_select(0, idx), [requests[i] for i in rows]
        )
        return best.index_copy(0, idx, drawn)

    def _draw(self, logits: torch.Tensor, best: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Inverse transform sampling of every row; rows left with nothing to draw from take ``best``."""
        weights = filtered_weights(logits, Filters.of(requests, logits.shape[1], logits.device))
        cum = weights.cumsum(dim=-1, dtype=torch.float64)
        total = cum[:, -1:]
        # x < total, so the first cum > x exists and is a token of nonzero weight.
        x = torch.minimum(
            self._uniforms(requests, logits.device)[:, None] * total, total.nextafter(torch.zeros_like(total))
        )
        drawn = torch.searchsorted(cum, x, right=True).clamp_(max=logits.shape[1] - 1).flatten()
        usable = torch.isfinite(total) & (total > 0)
        return torch.where(usable.flatten(), drawn, best)

    def _uniforms(self, requests: list[Request], device: torch.device) -> torch.Tensor:
        """One U[0, 1) per row: seeded requests from their own generator, the others from the sampler's."""
        seeded = [j for j, r in enumerate(requests) if r.generator is not None]
        if len(seeded) == len(requests):
            u = torch.empty(len(requests), dtype=torch.float64, device=device)
        else:
            u = torch.rand(
                len(requests), generator=self._generator(device), dtype=torch.float64, device=device
            )
        if seeded:
            own = [uniform(requests[j].generator) for j in seeded]
            u[to_tensor(seeded, torch.long, device)] = to_tensor(own, torch.float64, device)
        return u

    def _generator(self, device: torch.device) -> torch.Generator:
        if device.type == "cpu":
            return self.generator
        if device not in self._device_generators:
            self._device_generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._device_generators[device]


@dataclass
class _Slot:
    index: int  # row of _TokenHistory.all_counts / output_counts
    request: weakref.ref[Request]
    prompt_len: int  # -1: the row must be (re)built
    outputs: list[int]  # the output ids counted so far


@dataclass
class _Runs:
    """Token ids in runs, each run with its row and its count change (+1 or -1)."""

    ids: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    deltas: list[int] = field(default_factory=list)

    def add(self, row: int, ids: list[int], delta: int) -> None:
        if ids:
            self.ids.extend(ids)
            self.rows.append(row)
            self.lengths.append(len(ids))
            self.deltas.append(delta)


@dataclass
class _Changes:
    """The count changes one call queues: rows to clear, then prompt ids (+1) and output ids (+1 or -1)."""

    fresh: list[int] = field(default_factory=list)
    prompt: _Runs = field(default_factory=_Runs)
    output: _Runs = field(default_factory=_Runs)


class _TokenHistory:
    """Token counts of each penalised request, kept on the logits' device and updated incrementally.

    One row (slot) per request: ``all_counts`` counts its prompt and output ids (repetition penalty:
    seen = count > 0), ``output_counts`` its output ids (frequency and presence penalties). A call applies
    only what changed since the request was last sampled: appended ids, or ids cut off the tail (a
    rollback), so the prompt is read once. Anything else (the prompt changed, or the last counted output
    id differs) rebuilds the request's row. A preempted request keeps its outputs and its row; a row is
    freed once its request finishes or is garbage collected.
    """

    def __init__(self) -> None:
        self.by_request: dict[int, _Slot] = {}  # id(request) -> slot, checked against the weakref
        self.free: list[int] = []
        self.all_counts = torch.zeros(0, 0, dtype=torch.int32)
        self.output_counts = torch.zeros(0, 0)  # float32, exact up to 2**24

    def release_finished(self) -> None:
        for key, slot in list(self.by_request.items()):
            req = slot.request()
            if req is None or req.is_finished:
                del self.by_request[key]
                self.free.append(slot.index)

    def slots(self, requests: Sequence[Request], vocab: int, device: torch.device) -> torch.Tensor:
        """The rows of ``requests`` (on ``device``), brought up to date with their token ids."""
        if self.all_counts.shape[1] != vocab or self.all_counts.device != device:
            self._reset(vocab, device)
        changes = _Changes()
        rows = [self._sync(req, vocab, changes) for req in requests]
        self._apply(changes, device)
        return to_tensor(rows, torch.long, device)

    def _apply(self, changes: _Changes, device: torch.device) -> None:
        if changes.fresh:
            at = to_tensor(changes.fresh, torch.long, device)
            self.all_counts[at] = 0
            self.output_counts[at] = 0
        prompt, output = changes.prompt, changes.output
        if not prompt.ids and not output.ids:
            return
        n, ids = len(prompt.ids), prompt.ids + output.ids
        runs = to_tensor(
            [prompt.rows + output.rows, prompt.lengths + output.lengths, prompt.deltas + output.deltas],
            torch.long,
            device,
        )
        rows, delta = runs[::2].repeat_interleave(runs[1], dim=1, output_size=len(ids))  # per id
        at = to_tensor(ids, torch.long, device)
        self.all_counts.index_put_((rows, at), delta.to(torch.int32), accumulate=True)
        self.output_counts.index_put_((rows[n:], at[n:]), delta[n:].float(), accumulate=True)

    def _sync(self, req: Request, vocab: int, changes: _Changes) -> int:
        """Queue what changed in ``req``'s ids since it was last counted; return its row."""
        slot = self.by_request.get(id(req))
        if slot is None or slot.request() is not req:
            if slot is not None:  # a collected request's, left by a caller that skipped release_finished
                self.free.append(slot.index)
            slot = _Slot(self._allocate(), weakref.ref(req), -1, [])
            self.by_request[id(req)] = slot
        outputs = req.output_token_ids
        keep = _still_counted(slot, req)
        if keep < 0:
            changes.fresh.append(slot.index)
            changes.prompt.add(slot.index, in_vocab(req.prompt_token_ids, vocab), 1)
            slot.prompt_len, slot.outputs, keep = len(req.prompt_token_ids), [], 0
        added = outputs[keep:]
        changes.output.add(slot.index, in_vocab(slot.outputs[keep:], vocab), -1)
        changes.output.add(slot.index, in_vocab(added, vocab), 1)
        del slot.outputs[keep:]
        slot.outputs.extend(added)
        return slot.index

    def _allocate(self) -> int:
        if not self.free:
            self._grow()
        return self.free.pop()

    def _grow(self) -> None:
        old, vocab = self.all_counts.shape
        new = max(8, 2 * old)
        more = torch.zeros(new - old, vocab, dtype=torch.int32, device=self.all_counts.device)
        self.all_counts = torch.cat([self.all_counts, more])
        self.output_counts = torch.cat([self.output_counts, more.float()])
        self.free.extend(range(new - 1, old - 1, -1))

    def _reset(self, vocab: int, device: torch.device) -> None:
        self.by_request.clear()
        self.free.clear()
        self.all_counts = torch.zeros(0, vocab, dtype=torch.int32, device=device)
        self.output_counts = torch.zeros(0, vocab, device=device)


def _still_counted(slot: _Slot, req: Request) -> int:
    """How many of the slot's counted outputs ``req`` still has (a prefix), or -1 to rebuild the row."""
    if slot.prompt_len != len(req.prompt_token_ids):
        return -1
    outputs = req.output_token_ids
    k = min(len(outputs), len(slot.outputs))
    return -1 if k and outputs[k - 1] != slot.outputs[k - 1] else k
