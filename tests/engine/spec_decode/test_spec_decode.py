"""MTP speculative decoding: greedy output equals transformers' batch-1 reference, token for token.

Drafts come from the real MTP layer (random weights: it is almost always wrong) or from an oracle that
proposes non-speculative hybridserve's own continuation with deliberate mistakes (or none), so that
verification accepts runs of every length, up to every draft of every step, and rolls back at every
offset. Speculative output must equal the non-speculative engine's token for token, and the reference's
up to proven ties. After every step, every cache row past a request's verified end is poisoned: a forward
that read a rolled-back row would change the tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from hybridserve import LLM, SamplingParams
from tests.engine.spec_decode.spec_helpers import (
    GREEDY,
    KV,
    MAX_NEW,
    check_greedy,
    mtp,
    oracle_drafts,
    poison_after_steps,
    spec_prompts,
)
from tests.reference import reference_greedy

CASES = {
    "batched": (dict(max_num_seqs=8, max_num_batched_tokens=64), 0),
    "chunked": (dict(max_num_seqs=4, max_num_batched_tokens=13), 0),
    "preempting": (
        dict(max_num_seqs=8, max_num_batched_tokens=32, num_blocks=12, enable_prefix_caching=False),
        0,
    ),
    "prefix_cached": (dict(max_num_seqs=4, max_num_batched_tokens=32), 20),
}


_PLAIN: dict[str, list[list[int]]] = {}


def _plain_tokens(folder: Path, case: str, prompts: list[list[int]]) -> list[list[int]]:
    """Non-speculative hybridserve's greedy tokens for ``case`` (one engine per case, shared by every k)."""
    if case not in _PLAIN:
        llm = LLM(str(folder), block_tokens=8, kv_cache_memory=KV, **CASES[case][0], enforce_eager=True)
        _PLAIN[case] = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    return _PLAIN[case]


@pytest.mark.parametrize(("k", "wrong"), [(1, 0.3), (2, 0.3), (3, 0.3), (3, 0.0)])
@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_with_mtp_equals_speculation_off_and_the_batch1_reference(
    tiny_checkpoint: Callable[[str], Path],
    mtp_checkpoint: Callable[[str], Path],
    case: str,
    k: int,
    wrong: float,
) -> None:
    base = tiny_checkpoint("mixed")
    kwargs, shared = CASES[case]
    prompts = spec_prompts(6, seed=5, shared_prefix=shared)
    expected = [reference_greedy(base, p, MAX_NEW) for p in prompts]
    plain = _plain_tokens(mtp_checkpoint("mixed"), case, prompts)
    with oracle_drafts({tuple(p): e for p, e in zip(prompts, plain, strict=True)}, wrong=wrong):
        llm = LLM(
            str(mtp_checkpoint("mixed")),
            block_tokens=8,
            kv_cache_memory=KV,
            speculative_config=mtp(k),
            **kwargs,
            enforce_eager=True,
        )
        poison_after_steps(llm.engine)
        outputs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == plain
    check_greedy(base, prompts, outputs, expected)
    snap = llm.engine.snapshot()
    assert (
        snap.spec_num_accepted_tokens > 0 and sum(snap.spec_accepted_per_pos) == snap.spec_num_accepted_tokens
    )
    assert len(snap.spec_accepted_per_pos) == k
    assert snap.spec_accepted_per_pos[-1] > 0  # whole runs of k drafts were accepted
    if wrong:
        assert snap.spec_num_draft_tokens > snap.spec_num_accepted_tokens
    else:  # every draft right: all accepted (none is drafted past a request's last token)
        assert snap.spec_num_accepted_tokens == snap.spec_num_draft_tokens
    if case == "preempting" and wrong:  # runs of accepted drafts finish requests before the pool runs dry
        assert snap.num_preemptions > 0
    if shared:
        assert snap.prefix_hit_tokens > 0
    llm.engine.pools.check_integrity()
    llm.engine.reset_prefix_cache()
    assert llm.engine.pools.all_free()


@pytest.mark.parametrize("model_name", ["mixed", "csa_heavy"])
def test_random_mtp_drafter_never_changes_a_token(
    tiny_checkpoint: Callable[[str], Path], mtp_checkpoint: Callable[[str], Path], model_name: str
) -> None:
    """The MTP layer's own (random, nearly always rejected) drafts: output equals speculation off."""
    prompts = spec_prompts(6, seed=2)
    kwargs = dict(block_tokens=8, kv_cache_memory=KV, max_num_seqs=4, max_num_batched_tokens=24)
    plain = LLM(str(mtp_checkpoint(model_name)), **kwargs, enforce_eager=True).generate(prompts, GREEDY)
    llm = LLM(str(mtp_checkpoint(model_name)), speculative_config=mtp(3), **kwargs, enforce_eager=True)
    poison_after_steps(llm.engine)
    spec = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.snapshot().spec_num_draft_tokens > 0
    llm.engine.pools.check_integrity()
    llm.engine.reset_prefix_cache()
    assert llm.engine.pools.all_free()


def test_stops_inside_an_accepted_run_end_at_the_right_token(
    tiny_checkpoint: Callable[[str], Path],
    mtp_checkpoint: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stop token, EOS, a stop string, max_tokens or max_model_len inside a run of accepted drafts."""
    base = tiny_checkpoint("mixed")
    prompts = spec_prompts(4, seed=9)
    expected = [reference_greedy(base, p, MAX_NEW) for p in prompts]
    continuations = {tuple(p): e for p, e in zip(prompts, expected, strict=True)}
    stop_ids = [[e[5]] for e in expected]
    cases = [
        [SamplingParams(temperature=0, max_tokens=MAX_NEW, stop_token_ids=s) for s in stop_ids],
        [SamplingParams(temperature=0, max_tokens=7, ignore_eos=True) for _ in prompts],
        [SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=4, stop_token_ids=s) for s in stop_ids],
    ]
    kwargs = dict(block_tokens=8, kv_cache_memory=KV, max_num_seqs=4, max_num_batched_tokens=32)
    plain = LLM(str(mtp_checkpoint("mixed")), **kwargs, enforce_eager=True)
    with oracle_drafts(continuations, wrong=0.0):
        llm = LLM(str(mtp_checkpoint("mixed")), speculative_config=mtp(3), **kwargs, enforce_eager=True)
        for params in cases:
            ours, theirs = llm.generate(prompts, params), plain.generate(prompts, params)
            for a, b in zip(ours, theirs, strict=True):
                assert a.outputs[0].token_ids == b.outputs[0].token_ids
                assert (a.outputs[0].finish_reason, a.outputs[0].stop_reason) == (
                    b.outputs[0].finish_reason,
                    b.outputs[0].stop_reason,
                )
        # A stop string completed by a token in the middle of an accepted run.
        text = plain.generate(prompts[:1], GREEDY)[0].outputs[0].text
        stop = text[len(text) // 3 : len(text) // 3 + 2] if len(text.strip()) > 6 else None
        if stop:
            params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, stop=[stop])
            a, b = llm.generate(prompts[:1], params)[0], plain.generate(prompts[:1], params)[0]
            assert (a.outputs[0].text, a.outputs[0].token_ids) == (b.outputs[0].text, b.outputs[0].token_ids)
            assert a.outputs[0].finish_reason == "stop"
        # The context limit: a request may grow to max_model_len and no further.
        short = LLM(
            str(mtp_checkpoint("mixed")),
            speculative_config=mtp(3),
            max_model_len=48,
            **kwargs,
            enforce_eager=True,
        )
        short_plain = LLM(str(mtp_checkpoint("mixed")), max_model_len=48, **kwargs, enforce_eager=True)
        params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
        ours, theirs = short.generate(prompts, params), short_plain.generate(prompts, params)
        for prompt, a, b in zip(prompts, ours, theirs, strict=True):
            assert len(prompt) + len(a.outputs[0].token_ids) == 48
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert llm.engine.snapshot().spec_num_accepted_tokens > 0


def test_drafts_count_against_the_token_budget(
    mtp_checkpoint: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM(
        str(mtp_checkpoint("mixed")),
        block_tokens=8,
        kv_cache_memory=KV,
        max_num_seqs=4,
        max_num_batched_tokens=10,
        speculative_config=mtp(3),
        enforce_eager=True,
    )
    seen: list[int] = []
    schedule = llm.engine.scheduler.schedule

    def recording() -> object:
        out = schedule()
        seen.append(out.num_tokens)
        return out

    monkeypatch.setattr(llm.engine.scheduler, "schedule", recording)
    llm.generate(spec_prompts(4, seed=1), GREEDY)
    assert max(seen) <= 10


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"method": "eagle", "num_speculative_tokens": 1}, "unknown method"),
        ({"method": "mtp", "num_speculative_tokens": 0}, ">= 1"),
        ({"method": "mtp"}, ">= 1"),
        ('{"method": "mtp", ', "not valid JSON"),
    ],
)
def test_bad_speculative_config_is_refused(
    tiny_checkpoint: Callable[[str], Path], config: object, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_checkpoint("mixed")), kv_cache_memory=KV, speculative_config=config, enforce_eager=True)


def test_checkpoint_without_mtp_weights_is_refused(tiny_checkpoint: Callable[[str], Path]) -> None:
    with pytest.raises(ValueError, match="needs MTP weights"):
        LLM(str(tiny_checkpoint("mixed")), kv_cache_memory=KV, speculative_config=mtp(1), enforce_eager=True)


def test_generate_and_plan_take_the_speculative_config(
    mtp_checkpoint: Callable[[str], Path], capsys: pytest.CaptureFixture
) -> None:
    from hybridserve.cli import main

    folder, spec = str(mtp_checkpoint("mixed")), '{"method": "mtp", "num_speculative_tokens": 2}'
    args = ["--model", folder, "--speculative-config", spec, "--kv-cache-memory", KV, "--enforce-eager"]
    assert main(["generate", *args, "--max-tokens", "4", "hi"]) == 0
    usable = ["--num-blocks", "8", "--max-num-batched-tokens", "32"]  # a plan the engine would start with
    assert main(["plan", "--model", folder, "--speculative-config", spec, *usable]) == 0
    out = capsys.readouterr().out
    assert "[4 tokens" in out and "mtp_kv" in out and "draft groups" in out
    assert main(["generate", "--model", folder, "--speculative-config", '{"method": "ngram"}', "hi"]) == 2
    assert "unknown method 'ngram'" in capsys.readouterr().err


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_grammar_constrains_drafts_and_verification(
    mtp_checkpoint: Callable[[str], Path], temperature: float
) -> None:
    """Structured outputs under speculation: greedy text equals speculation off; sampled text matches."""
    import re

    from hybridserve.engine.request import StructuredOutputsParams

    folder = str(mtp_checkpoint("mixed"))
    pattern = r"[a-e]{2,5}-[0-9]{1,3}"
    params = SamplingParams(
        temperature=temperature,
        max_tokens=16,
        seed=3,
        structured_outputs=StructuredOutputsParams(regex=pattern),
    )
    prompts = spec_prompts(3, seed=4)
    spec = LLM(
        folder, block_tokens=8, kv_cache_memory=KV, speculative_config=mtp(3), enforce_eager=True
    ).generate(prompts, params)
    for out in spec:
        assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text
    if temperature == 0:
        plain = LLM(folder, block_tokens=8, kv_cache_memory=KV, enforce_eager=True).generate(prompts, params)
        assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
