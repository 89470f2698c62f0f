"""A few training steps of a tiny config on a tiny text: writes a loadable checkpoint with MTP tensors."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from hybridserve.train import train
from hybridserve.train.checkpoint import load_mtp, load_trunk

ASSET = Path(__file__).resolve().parents[2] / "hybridserve" / "assets" / "austen-v4"


def test_train_smoke(tmp_path: Path) -> None:
    text = (ASSET / "heldout.txt").read_text(encoding="utf-8")
    (tmp_path / "train.txt").write_text(text[:30_000], encoding="utf-8")
    (tmp_path / "val.txt").write_text(text[-4_000:], encoding="utf-8")
    out = tmp_path / "ckpt"
    threads = torch.get_num_threads()
    try:
        train.main(
            [
                "--out",
                str(out),
                "--train-text",
                str(tmp_path / "train.txt"),
                "--heldout",
                str(tmp_path / "val.txt"),
                "--preset",
                "tiny",
                "--vocab-size",
                "320",
                "--seq-len",
                "64",
                "--batch-size",
                "2",
                "--steps",
                "4",
                "--warmup",
                "2",
                "--val-every",
                "2",
                "--log-every",
                "1",
                "--threads",
                "1",
                "--quiet",
            ]
        )
    finally:
        torch.set_num_threads(threads)

    for name in (
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "train_log.jsonl",
    ):
        assert (out / name).is_file(), name
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "deepseek_v4"
    assert config["num_nextn_predict_layers"] == 1

    records = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    steps = [r for r in records if "step" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all("train_loss" in r and "train_mtp_loss" in r for r in steps)
    assert sum("val_loss" in r for r in steps) == 2
    assert records[-1]["event"] == "end"

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {"mtp.0.e_proj.weight", "mtp.0.hc_head_fn", "mtp.0.attn.wq_a.weight"} <= keys
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    # hash routing was filled (distinct experts per token), not left at transformers' all-zeros
    table = model.model.layers[0].mlp.gate.tid2eid
    assert (table[:, 0] != table[:, 1]).all()

    trunk = load_trunk(out)
    mtp = load_mtp(out, trunk)
    ids = torch.randint(5, trunk.config.vocab_size, (1, 16))
    with torch.no_grad():
        trunk(input_ids=ids)
        logits = mtp(
            torch.randn(1, 15, trunk.config.hc_mult, trunk.config.hidden_size),
            ids[:, 1:],
            trunk.model.embed_tokens,
            trunk.lm_head,
        )
    assert logits.shape == (1, 15, trunk.config.vocab_size)
    assert torch.isfinite(logits).all()
