"""One growing token list per request, and the batch builder's single transfers against the old build."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import random

import pytest
import torch

from hybridserve.engine.core.scheduler import ScheduledRequest
from hybridserve.engine.request import OutputTokens, Request, SamplingParams
from tests.models.test_attention_meta_static import GEOMETRIES, KINDS, Scenario


def test_all_token_ids_is_one_list_that_grows_with_the_output() -> None:
    req = Request("a", [5, 6, 7], SamplingParams())
    tokens = req.all_token_ids
    for t in range(10):
        req.output_token_ids.append(t)
        assert req.all_token_ids is tokens
    req.output_token_ids.extend([20, 21])
    req.output_token_ids += [22]
    assert tokens == [5, 6, 7, *range(10), 20, 21, 22]
    assert req.output_token_ids == [*range(10), 20, 21, 22] and req.prompt_token_ids == [5, 6, 7]
    assert req.num_tokens == len(tokens)


def test_every_list_change_of_the_output_keeps_the_combined_list() -> None:
    req = Request("a", [1, 2], SamplingParams())
    rng = random.Random(0)
    for _ in range(3000):
        out, n = req.output_token_ids, len(req.output_token_ids)
        op = rng.randrange(9)
        if op == 0:
            out.append(rng.randrange(99))
        elif op == 1:
            out.extend(iter([rng.randrange(99) for _ in range(rng.randrange(4))]))
        elif op == 2 and n:
            del out[rng.randrange(-n, n) : rng.choice([None, rng.randrange(-n - 1, n + 1)])]
        elif op == 3 and n:
            out.pop(rng.randrange(-n, n))
        elif op == 4 and n:
            out[rng.randrange(n)] = 0
        elif op == 5:
            out[1:3] = [4, 4, 4]
        elif op == 6 and n:
            del out[rng.randrange(-n, n)]
        elif op == 7:
            out.insert(rng.randrange(n + 1), 8)
        elif op == 8 and n > 40:
            del out[::3]
        assert req.all_token_ids == req.prompt_token_ids + list(out)


def test_replaced_lists_and_copies_stay_consistent() -> None:
    req = Request("a", [1, 2], SamplingParams())
    req.output_token_ids.append(3)
    req.output_token_ids = [7]
    assert req.all_token_ids == [1, 2, 7]
    req.prompt_token_ids = [0]
    assert req.all_token_ids == [0, 7]
    for other in (pickle.loads(pickle.dumps(req)), copy.deepcopy(req)):
        assert other.all_token_ids == [0, 7]
        other.output_token_ids.append(8)
        assert other.all_token_ids == [0, 7, 8] and req.all_token_ids == [0, 7]
    assert isinstance(req.output_token_ids, OutputTokens) and req.output_token_ids == [7]


def _old_tables(scheduled: list[ScheduledRequest], s: Scenario) -> dict[str, torch.Tensor]:
    tables = [s.coord.block_tables(x.request.request_id) for x in scheduled]
    out = {}
    for name in tables[0]:
        rows = [t[name] for t in tables]
        width = max(1, max(len(r) for r in rows))
        out[name] = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long)
    return out


@pytest.mark.parametrize("seed", range(12))
def test_forward_batch_equals_the_old_build(seed: int) -> None:
    rng = random.Random(seed)
    s = Scenario(GEOMETRIES[seed % len(GEOMETRIES)], seed)
    for _ in range(rng.randrange(1, 7)):
        s.add(rng.choice(KINDS))
    for x in s.scheduled:  # some requests already have output tokens
        x.request.output_token_ids.extend(range(rng.randrange(3)))
    batch = s.batch()
    ids, pos, req, logits = [], [], [], []
    for r, x in enumerate(s.scheduled):
        ids += (x.request.prompt_token_ids + x.request.output_token_ids)[x.start : x.end]
        pos += range(x.start, x.end)
        req += [r] * x.num_tokens
        if x.samples:
            logits.append(len(ids) - 1)
    assert batch.input_ids.tolist() == ids and batch.positions.tolist() == pos
    assert batch.req_indices.tolist() == req and batch.logits_indices.tolist() == logits
    assert batch.seq_ends.tolist() == [x.end for x in s.scheduled]
    assert batch.layout is not None
    assert dataclasses.replace(batch, layout=None).host_layout() == batch.layout
    for name, old in _old_tables(s.scheduled, s).items():
        new = batch.block_tables[name]
        assert torch.equal(new[:, : old.shape[1]], old) and not new[:, old.shape[1] :].any()
