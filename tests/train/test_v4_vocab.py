"""The bundled tokenizer's DeepSeek-V4 tokens, the vocabulary extension that made them, the trunk resize and
the synthetic conversations of the chat fine-tune."""

from __future__ import annotations

import random
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer as HFTokenizer

from hybridserve.chat_format.dsml import END_THINK, THINK
from hybridserve.tokenizer import Tokenizer
from hybridserve.train.chat_data import ChatExample, ChatMaker
from hybridserve.train.checkpoint import load_mtp, load_trunk
from hybridserve.train.finetune_chat import masked_losses, target_mask
from hybridserve.train.model import JointModel
from hybridserve.train.resize_vocab import embedding_rows, resize_vocab
from hybridserve.train.tokenizer import train_tokenizer
from hybridserve.train.v4_tokens import V4_TOKENS, NewToken, extend_tokenizer
from tests.server.deepseek_v4_server import DSML_CALL, MAX_CALL_TOKENS

ASSET = Path(__file__).resolve().parents[2] / "hybridserve" / "assets" / "austen-v4"
EOS = "<｜end▁of▁sentence｜>"


def test_bundled_tokenizer_has_v4_tokens_as_single_unspecial_tokens() -> None:
    tok = Tokenizer(ASSET, "deepseek_v4")
    for text in V4_TOKENS:
        ids = tok.encode(text, add_special_tokens=False)
        assert len(ids) == 1, text
        assert tok.decode(ids) == text  # kept when special tokens are skipped: the parsers read it
    call = tok.encode(DSML_CALL + EOS, add_special_tokens=False)
    assert len(call) <= MAX_CALL_TOKENS
    assert tok.decode(call, skip_special_tokens=False) == DSML_CALL + EOS


def test_extension_appends_tokens_and_keeps_old_ids() -> None:
    text = (ASSET / "heldout.txt").read_text()[:40_000]
    base = train_tokenizer([text], 400)
    first_new = base.get_vocab_size(with_added_tokens=True)
    extended, new = extend_tokenizer(base)
    assert [t.token_id for t in new] == list(range(first_new, first_new + len(new)))
    assert [t.text for t in new if not t.parts] == list(V4_TOKENS)
    vocab = extended.get_vocab(with_added_tokens=True)
    assert all(vocab[t] == i for t, i in base.get_vocab(with_added_tokens=True).items())
    assert extended.decode(extended.encode(text).ids) == text
    assert len(extended.encode(DSML_CALL).ids) < len(base.encode(DSML_CALL).ids) / 2
    bundled = HFTokenizer.from_file(str(ASSET / "tokenizer.json"))
    assert extend_tokenizer(bundled)[1] == []  # the bundled tokenizer has them all


def test_new_rows_mean_what_they_merge() -> None:
    old = torch.arange(12.0).reshape(4, 3)
    new = [NewToken(4, "ab", (0, 1)), NewToken(5, "abc", (4, 2)), NewToken(6, "<x>", ())]
    rows = embedding_rows(old, new)
    assert torch.equal(rows[:4], old)
    assert torch.allclose(rows[4], (old[0] + old[1]) / 2)
    assert torch.allclose(rows[5], (rows[4] + old[2]) / 2)
    assert torch.allclose(rows[6], old.mean(dim=0))


def test_resize_keeps_old_logits_order_and_routes_new_tokens(
    tiny_checkpoint,  # type: ignore[no-untyped-def]
) -> None:
    trunk = load_trunk(tiny_checkpoint("mixed")).eval()
    vocab = trunk.config.vocab_size
    ids = torch.randint(3, vocab, (1, 12), generator=torch.Generator().manual_seed(0))
    before = trunk(input_ids=ids).logits
    resize_vocab(trunk, [NewToken(vocab, "x", (3, 4)), NewToken(vocab + 1, "<y>", ())], seed=0)
    after = trunk(input_ids=ids).logits
    assert after.shape[-1] == vocab + 2 == trunk.config.vocab_size
    assert torch.allclose(after[..., :vocab], before, atol=1e-5)
    table = trunk.model.layers[0].mlp.gate.tid2eid
    assert table.shape[0] == vocab + 2 and (table[:, 0] != table[:, 1]).all()
    assert trunk(input_ids=torch.tensor([[vocab, vocab + 1]])).logits.isfinite().all()


def test_chat_examples_train_every_assistant_turn() -> None:
    tok = Tokenizer(ASSET, "deepseek_v4")
    maker = ChatMaker(tok, {"Emma": ["Emma was very fond of her father."]}, random.Random(0))
    think, end = (tok.encode(t, add_special_tokens=False)[0] for t in (THINK, END_THINK))
    seen = set()
    for _ in range(24):
        ex = maker.example()
        texts = [tok.decode(ex.ids[a:b], skip_special_tokens=False) for a, b in ex.targets]
        seen.add((ex.has_tools, any("<｜DSML｜tool_calls>" in t for t in texts)))
        for (a, b), text in zip(ex.targets, texts, strict=True):
            assert ex.ids[a - 1] == (think if ex.thinking else end)  # the prompt ends in the mode's tag
            assert text.endswith(EOS) and (END_THINK in text) == ex.thinking
            assert b == len(ex.ids) or tok.decode([ex.ids[b]], skip_special_tokens=False) == "<｜User｜>"
    assert {(False, False), (True, True)} <= seen


def test_the_fine_tune_loss_counts_only_target_tokens(mtp_checkpoint) -> None:  # type: ignore[no-untyped-def]
    folder = mtp_checkpoint("mixed")
    trunk = load_trunk(folder)
    joint = JointModel(trunk, load_mtp(folder, trunk), mtp_weight=0.3).eval()
    ids = torch.randint(3, trunk.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    ex = ChatExample(ids[0].tolist(), [(5, 9), (12, 16)], has_tools=True, thinking=False)
    mask = target_mask(ex)
    assert mask.nonzero().flatten().tolist() == [5, 6, 7, 8, 12, 13, 14, 15]
    main, mtp = masked_losses(joint, ids, mask)
    logits, mtp_logits = joint(ids)
    picked = [p - 1 for p in (5, 6, 7, 8, 12, 13, 14, 15)]
    expected = F.cross_entropy(logits[0, picked], ids[0, [p + 1 for p in picked]])
    assert torch.allclose(main, expected, atol=1e-6)
    mtp_picked = [p - 2 for p in (5, 6, 7, 8, 12, 13, 14, 15)]
    mtp_expected = F.cross_entropy(mtp_logits[0, mtp_picked], ids[0, [p + 2 for p in mtp_picked]])
    assert torch.allclose(mtp, mtp_expected, atol=1e-6)
