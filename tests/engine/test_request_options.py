"""Offline request options against references: prompt logprobs (transformers' log-softmax, under chunked
prefill), logit_bias, ``n`` choices, and ``LLM.chat`` (the same ids as the chat template's)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hybridserve import LLM, SamplingParams
from tests.reference import reference_greedy, reference_model


@pytest.fixture(scope="module")
def llm(tiny_checkpoint: Callable[[str], Path]) -> LLM:
    return LLM(str(tiny_checkpoint("mixed")), block_tokens=8, max_num_batched_tokens=16, enforce_eager=True)


def test_prompt_logprobs_equal_the_reference_log_softmax(
    tiny_checkpoint: Callable[[str], Path], llm: LLM
) -> None:
    prompts = [list(range(7, 7 + 37)), [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
    llm.generate(prompts[:1], SamplingParams(max_tokens=2))  # cached: prompt logprobs must not reuse it
    outs = llm.generate(prompts, SamplingParams(max_tokens=2, prompt_logprobs=3, temperature=0))
    model = reference_model(tiny_checkpoint("mixed"))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
        assert out.prompt_logprobs[0] is None
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
        for p in range(1, len(prompt)):
            entry = out.prompt_logprobs[p]
            assert entry is not None and prompt[p] in entry
            assert entry[prompt[p]].logprob == pytest.approx(float(ref[p - 1, prompt[p]]), abs=1e-4)
            assert entry[prompt[p]].rank == int((ref[p - 1] > ref[p - 1, prompt[p]]).sum()) + 1
            top = {t: lp for t, lp in entry.items() if lp.rank <= 3}
            assert set(top) >= set(ref[p - 1].topk(3).indices.tolist()) - {prompt[p]}


def test_logit_bias_moves_greedy_choices(tiny_checkpoint: Callable[[str], Path], llm: LLM) -> None:
    prompt = [5, 9, 33, 70, 71]
    free = reference_greedy(tiny_checkpoint("mixed"), prompt, 6)
    forced = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, logit_bias={42: 100.0}))
    assert forced[0].outputs[0].token_ids == [42] * 6
    banned = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, logit_bias={free[0]: -100.0}))
    assert banned[0].outputs[0].token_ids[0] != free[0]


def test_n_offline_returns_n_choices_with_consecutive_seeds(llm: LLM) -> None:
    prompt = [5, 9, 33, 70]
    many = llm.generate([prompt, prompt[:2]], SamplingParams(n=3, seed=7, temperature=1.0, max_tokens=8))
    assert [len(o.outputs) for o in many] == [3, 3]
    assert [c.index for c in many[0].outputs] == [0, 1, 2]
    for j in range(3):
        alone = llm.generate([prompt], SamplingParams(seed=7 + j, temperature=1.0, max_tokens=8))
        assert alone[0].outputs[0].token_ids == many[0].outputs[j].token_ids


def test_chat_renders_the_template_and_generates(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    assert tokenizer is not None
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    ids, _ = tokenizer.encode_chat(conversation)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    (one,) = llm.chat(conversation, params)
    assert one.prompt_token_ids == ids
    assert one.outputs[0].token_ids == llm.generate([ids], params)[0].outputs[0].token_ids
    two = llm.chat(
        [conversation, conversation[1:]], params, chat_template="{{ 'X' }}{{ messages[-1]['content'] }}"
    )
    assert two[0].prompt_token_ids == tokenizer.encode("XHello there", add_special_tokens=False)


def test_chat_speaks_deepseek_v4_for_a_v4_checkpoint_without_a_template(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    assert tokenizer is not None and tokenizer.mode == "deepseek_v4"
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    conversation = [{"role": "user", "content": "Hello there"}]
    (one,) = llm.chat(conversation, params, chat_template_kwargs={"thinking": False})
    text = "<｜begin▁of▁sentence｜><｜User｜>Hello there<｜Assistant｜></think>"
    assert tokenizer.decode(one.prompt_token_ids, skip_special_tokens=False) == text
