"""Structured outputs in the engine: grammar-masked greedy equals a one-at-a-time reference (transformers
with the same xgrammar matcher applied step by step), under batching, chunked prefill and preemption, mixed
with unconstrained requests; draft masks; the compiled-grammar cache; the bundled model's JSON."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import jsonschema_rs
import pytest
import torch
import xgrammar as xgr

from hybridserve import LLM, SamplingParams
from hybridserve.engine.errors import RequestRejected
from hybridserve.engine.request import Request, StructuredOutputsParams
from hybridserve.engine.sample.structured_outputs import StructuredOutputs, unpack_bitmask
from tests.reference import reference_greedy, reference_model

BUNDLED = str(Path(__file__).resolve().parents[3] / "hybridserve" / "assets" / "austen-v4")
MAX_NEW = 24
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
}
SPECS = [
    StructuredOutputsParams(json=SCHEMA),
    StructuredOutputsParams(regex=r"[a-e]{2,5}-[0-9]{1,3}"),
    StructuredOutputsParams(choice=["truth", "pride", "prejudice"]),
    StructuredOutputsParams(grammar='root ::= "(" ([a-z] | " ")* ")"'),
    StructuredOutputsParams(json_object=True),
]


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(5, 300, (int(torch.randint(4, 40, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


def _matcher(llm: LLM, spec: StructuredOutputsParams) -> xgr.GrammarMatcher:
    return xgr.GrammarMatcher(llm.engine.structured.compile(spec))


def reference_constrained(
    folder: Path, llm: LLM, prompt: list[int], spec: StructuredOutputsParams
) -> list[int]:
    """Greedy decoding of transformers' model, one sequence, masked by a fresh matcher of the same grammar."""
    model = reference_model(folder)
    matcher = _matcher(llm, spec)
    ids, out = list(prompt), []
    vocab = model.config.vocab_size
    with torch.no_grad():
        while len(out) < MAX_NEW and not matcher.is_terminated():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            mask = xgr.allocate_token_bitmask(1, vocab)
            matcher.fill_next_token_bitmask(mask)
            token = int(logits.masked_fill(~unpack_bitmask(mask, vocab)[0], float("-inf")).argmax())
            assert matcher.accept_token(token)
            ids.append(token)
            out.append(token)
    return out


@pytest.fixture(scope="module")
def preempting(tiny_checkpoint: Callable[[str], Path]) -> LLM:
    folder = tiny_checkpoint("mixed")
    return LLM(
        str(folder),
        block_tokens=8,
        max_num_seqs=12,
        max_num_batched_tokens=24,
        num_blocks=12,
        enable_prefix_caching=False,
        enforce_eager=True,
    )


def test_constrained_and_free_requests_under_batching_and_preemption_equal_references(
    tiny_checkpoint: Callable[[str], Path], preempting: LLM
) -> None:
    folder = tiny_checkpoint("mixed")
    prompts = _prompts(12, seed=5)
    specs = [SPECS[i % len(SPECS)] if i % 3 else None for i in range(len(prompts))]
    params = [
        SamplingParams(temperature=0, max_tokens=MAX_NEW, structured_outputs=s, ignore_eos=s is None)
        for s in specs
    ]
    before = preempting.engine.scheduler.num_preemptions
    outputs = preempting.generate(prompts, params)
    assert preempting.engine.scheduler.num_preemptions > before, "the pool was meant to force preemption"
    for prompt, spec, out in zip(prompts, specs, outputs, strict=True):
        ours = out.outputs[0].token_ids
        if spec is None:
            assert ours == list(reference_greedy(folder, prompt, MAX_NEW))
            continue
        assert ours == reference_constrained(folder, preempting, prompt, spec), spec
        matcher = _matcher(preempting, spec)
        assert all(matcher.accept_token(t) for t in ours)  # every token the grammar's
        assert matcher.is_terminated() == (out.outputs[0].finish_reason == "stop")
    assert preempting.engine.pools.all_free()


def test_draft_masks_equal_the_masks_after_accepting_the_drafts(preempting: LLM) -> None:
    structured = preempting.engine.structured
    spec = StructuredOutputsParams(regex=r"ab[cd]+e")
    tokenizer = preempting.tokenizer
    assert tokenizer is not None
    drafts = tokenizer.encode("abcd", add_special_tokens=False)
    vocab = preempting.engine.model.cfg.vocab_size
    req = Request("drafted", [5, 6], SamplingParams(structured_outputs=spec))
    structured.add_request(req)
    masks = xgr.allocate_token_bitmask(len(drafts) + 1, vocab)
    assert structured.fill_bitmask(req, masks, 0, drafts) == len(drafts) + 1
    for k in range(len(drafts) + 1):  # the same masks, one accepted token at a time
        req.output_token_ids[:] = drafts[:k]
        one = xgr.allocate_token_bitmask(1, vocab)
        structured.fill_bitmask(req, one, 0)
        assert torch.equal(one[0], masks[k]), k
    req.output_token_ids[:] = []  # a rollback of every draft
    one = xgr.allocate_token_bitmask(1, vocab)
    structured.fill_bitmask(req, one, 0)
    assert torch.equal(one[0], masks[0])


def test_compiled_grammars_are_cached_and_bad_ones_rejected(preempting: LLM) -> None:
    structured: StructuredOutputs = preempting.engine.structured
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"k": {"type": "integer"}}})
    structured.compile(spec)
    count = structured.compile_count
    preempting.generate([[5, 6, 7]] * 3, SamplingParams(max_tokens=4, structured_outputs=spec))
    assert structured.compile_count == count
    for bad, words in [
        (StructuredOutputsParams(json={"type": "nonsense"}), "JSON schema"),
        (StructuredOutputsParams(regex="(ab"), "regex"),
        (StructuredOutputsParams(grammar='start ::= "a"'), "root"),
    ]:
        with pytest.raises(RequestRejected, match=words):
            preempting.generate([[5, 6]], SamplingParams(max_tokens=4, structured_outputs=bad))
    assert preempting.engine.pools.all_free() and not preempting.engine.has_unfinished_requests()


def test_the_bundled_model_emits_schema_valid_json() -> None:
    llm = LLM(BUNDLED, max_num_seqs=4, enforce_eager=True)
    schema = {
        "type": "object",
        "properties": {
            "heroine": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 16, "maximum": 40},
            "married": {"type": "boolean"},
            "suitors": {"type": "array", "items": {"enum": ["Darcy", "Wickham", "Collins"]}, "maxItems": 3},
        },
        "required": ["heroine", "age", "married", "suitors"],
    }
    prompts = ["Elizabeth Bennet is", "Emma Woodhouse was", "The character sheet:"]
    params = [
        SamplingParams(
            temperature=t, seed=3, max_tokens=80, structured_outputs=StructuredOutputsParams(json=schema)
        )
        for t in (0.0, 0.8, 1.0)
    ]
    validator = jsonschema_rs.validator_for(schema)
    for out in llm.generate(prompts, params):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        assert validator.is_valid(json.loads(out.outputs[0].text)), out.outputs[0].text


def test_the_grammar_compiler_is_warmed_at_start_up_not_by_the_first_constrained_request() -> None:
    """xgrammar's first use (import, the vocabulary's token table) happens in a start-up thread, so the
    first constrained request builds nothing: it costs what later ones do."""
    core = LLM(BUNDLED, max_num_seqs=4, enforce_eager=True).engine
    warm_up = core.grammar_warm_up
    assert warm_up is not None and warm_up.name == "grammar-warm-up"
    warm_up.join(timeout=120)
    structured = core.structured
    assert structured.compiler_builds == 1 and structured.compile_count == 1
    params = SamplingParams(
        temperature=0, max_tokens=4, structured_outputs=StructuredOutputsParams(json_object=True)
    )
    core.add_request(Request("first", [5, 6, 7], params))
    while core.has_unfinished_requests():
        core.step()
    assert structured.compiler_builds == 1 and structured.compile_count == 1  # warmed, cached, not rebuilt


def test_no_warm_up_without_a_tokenizer(tmp_path: Path) -> None:
    assert StructuredOutputs(tmp_path, 32, [0]).start_warm_up() is None
