"""The bundled austen-v4 checkpoint: loads cleanly in transformers, tokenizer round-trips, MTP head works."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridserve.train.checkpoint import load_mtp
from hybridserve.train.evaluate import heldout_metrics, heldout_windows
from hybridserve.train.model import JointModel
from hybridserve.train.tokenizer import ASSISTANT, BOS, EOS, PAD, USER
from tests.train.test_mtp_mapping import OWN_NAMES

ASSET = Path(__file__).resolve().parents[2] / "hybridserve" / "assets" / "austen-v4"
TEXT = 'Emma said, "It is a truth—naïve, café, 日本語, 🙂." \n\n\tTabs  and  spaces.'
# Measured 0.271 on the first 3,000 held-out tokens after the chat fine-tune and the MTP layer's second
# distillation (0.277 before the fine-tune; model card); majority-token baseline 0.053.
MIN_MTP_TOP1 = 0.15


@pytest.fixture(scope="module")
def loaded():  # type: ignore[no-untyped-def]
    threads = torch.get_num_threads()
    torch.set_num_threads(min(threads, 2))
    model, info = AutoModelForCausalLM.from_pretrained(ASSET, output_loading_info=True)
    yield model.eval(), info
    torch.set_num_threads(threads)


def test_files_and_config() -> None:
    names = {p.name for p in ASSET.iterdir()}
    expected = {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"}
    assert expected | {"tokenizer_config.json", "README.md", "heldout.txt"} <= names
    config = json.loads((ASSET / "config.json").read_text())
    assert config["model_type"] == "deepseek_v4"
    assert config["num_nextn_predict_layers"] == 1
    assert (ASSET / "model.safetensors").stat().st_size <= 30_000_000
    assert (ASSET / "heldout.txt").stat().st_size <= 1_000_000
    generation = json.loads((ASSET / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"], generation["pad_token_id"]) == (0, 1, 2)
    assert generation["temperature"] == pytest.approx(0.8)
    assert generation["top_p"] == pytest.approx(0.95)


def test_transformers_loads_every_trunk_weight(loaded, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    model, info = loaded
    assert not info["missing_keys"]
    assert not info["mismatched_keys"]
    assert not [k for k in info["unexpected_keys"] if not k.startswith("mtp.")]
    with safe_open(str(ASSET / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    mtp_keys = {k for k in keys if k.startswith("mtp.")}
    assert OWN_NAMES | {"mtp.0.attn.wq_a.weight", "mtp.0.attn.attn_sink", "mtp.0.ffn.gate.bias"} <= mtp_keys
    # every non-MTP tensor on disk reaches the transformers model: re-saving it writes the same tensors
    model.save_pretrained(tmp_path)
    resaved = load_file(str(tmp_path / "model.safetensors"))
    assert set(resaved) == keys - mtp_keys
    with safe_open(str(ASSET / "model.safetensors"), "pt") as f:
        for key, value in resaved.items():
            assert torch.equal(value, f.get_tensor(key)), key
    table = model.model.layers[0].mlp.gate.tid2eid
    assert (table[:, 0] != table[:, 1]).all()


def test_tokenizer_round_trip() -> None:
    fast = Tokenizer.from_file(str(ASSET / "tokenizer.json"))
    ids = fast.encode(TEXT).ids
    assert ids[0] == 0
    assert fast.decode(ids, skip_special_tokens=True) == TEXT
    assert fast.decode(fast.encode(TEXT, add_special_tokens=False).ids) == TEXT
    assert [fast.token_to_id(t) for t in (BOS, EOS, PAD, USER, ASSISTANT)] == [0, 1, 2, 3, 4]

    auto = AutoTokenizer.from_pretrained(ASSET)
    assert (auto.bos_token, auto.eos_token, auto.pad_token) == (BOS, EOS, PAD)
    assert auto.decode(auto(TEXT)["input_ids"], skip_special_tokens=True) == TEXT
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Who?"},
    ]
    prompt = auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == f"{BOS}Be brief.{USER}Hi{ASSISTANT}Hello{EOS}{USER}Who?{ASSISTANT}"


def test_mtp_predicts_token_after_next(loaded) -> None:  # type: ignore[no-untyped-def]
    model, _ = loaded
    tok = Tokenizer.from_file(str(ASSET / "tokenizer.json"))
    text = (ASSET / "heldout.txt").read_text(encoding="utf-8")
    windows = heldout_windows(tok, text, seq_len=512, bos_id=0, max_tokens=3000)
    metrics = heldout_metrics(JointModel(model, load_mtp(ASSET, model), mtp_weight=0.0), windows)
    assert metrics.mtp_top1 > MIN_MTP_TOP1
    assert metrics.mtp_top1 > 2.5 * metrics.majority_baseline
