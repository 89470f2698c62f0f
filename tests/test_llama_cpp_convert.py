"""benchmarks/peers/llama_cpp_convert.py (our checkpoint -> llama.cpp GGUF) without the llama.cpp build:
every tensor of a checkpoint gets a llama.cpp name or a reason to be left out, llama.cpp's geometry
limits are checked, and our tokenizer is what llama.cpp's ``gpt-2`` pre-tokenizer splits like.
The ids proof against the built ``llama-tokenize`` is ``llama_cpp_convert.py --check-tokenizer``."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "peers"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import llama_cpp_convert as conv
import run_peers

ROOT = Path(__file__).resolve().parent.parent

BUNDLED = ROOT / "hybridserve" / "assets" / "austen-v4"
# What src/models/deepseek4.cpp creates per layer, by compress ratio (hash layer 0 has tid2eid, the
# others exp_probs_b).
COMMON = {
    "ATTN_NORM", "ATTN_SINKS", "ATTN_Q_A", "ATTN_Q_A_NORM", "ATTN_Q_B", "ATTN_KV", "ATTN_KV_NORM",
    "ATTN_OUT_A", "ATTN_OUT_B", "HC_ATTN_FN", "HC_ATTN_BASE", "HC_ATTN_SCALE", "HC_FFN_FN",
    "HC_FFN_BASE", "HC_FFN_SCALE", "FFN_GATE_INP", "FFN_NORM", "FFN_GATE_SHEXP", "FFN_DOWN_SHEXP",
    "FFN_UP_SHEXP",
}  # fmt: skip
COMPRESSOR = {"ATTN_COMPRESSOR_WKV", "ATTN_COMPRESSOR_WGATE", "ATTN_COMPRESSOR_APE", "ATTN_COMPRESSOR_NORM"}
INDEXER = {
    "INDEXER_PROJ", "INDEXER_ATTN_Q_B", "INDEXER_COMPRESSOR_WKV", "INDEXER_COMPRESSOR_WGATE",
    "INDEXER_COMPRESSOR_APE", "INDEXER_COMPRESSOR_NORM",
}  # fmt: skip


def _config() -> dict:
    return json.loads((BUNDLED / "config.json").read_text())


def test_every_tensor_has_a_llama_cpp_name_or_a_reason() -> None:
    cfg = _config()
    n_hash = conv.hash_layer_count(cfg)
    ratios = conv.compress_ratios(cfg)
    per_layer: dict[int, set[str]] = {}
    root: set[str] = set()
    experts: Counter[tuple[int, str]] = Counter()
    skipped: list[str] = []
    with safe_open(str(BUNDLED / "model.safetensors"), "np") as f:
        names = list(f.keys())
    for name in names:
        kind, what = conv.classify(name, n_hash)
        if kind == "skip":
            skipped.append(name)
        elif kind == "expert":
            experts[(what[0], what[2])] += 1
        else:
            member, _suffix, bid = what
            target = root if bid is None else per_layer.setdefault(bid, set())
            assert member not in target, f"two tensors map to {member} in layer {bid}"
            target.add(member)
    assert root == {"TOKEN_EMBD", "OUTPUT_NORM", "OUTPUT", "HC_HEAD_FN", "HC_HEAD_BASE", "HC_HEAD_SCALE"}
    for bid, ratio in enumerate(ratios):
        want = COMMON | (COMPRESSOR if ratio else set()) | (INDEXER if ratio == 4 else set())
        want |= {"FFN_GATE_TID2EID"} if bid < n_hash else {"FFN_EXP_PROBS_B"}
        assert per_layer[bid] == want, bid
        for member in ("FFN_GATE_EXP", "FFN_DOWN_EXP", "FFN_UP_EXP"):
            assert experts[(bid, member)] == cfg["n_routed_experts"]
    assert skipped and all(n.startswith("mtp.") for n in skipped)  # austen-v4's hash layer has no bias


def test_names_transformers_and_deepseek_spell_differently() -> None:
    assert conv.classify("model.layers.3.attn.norm.weight", 1) == ("tensor", ("ATTN_KV_NORM", ".weight", 3))
    assert conv.classify("model.layers.3.attn.compressor.norm.weight", 1)[1][0] == "ATTN_COMPRESSOR_NORM"
    assert conv.classify("model.hc_head.hc_fn", 1) == ("tensor", ("HC_HEAD_FN", ".weight", None))
    assert conv.classify("model.layers.0.ffn.gate.bias", 1)[0] == "skip"
    assert conv.classify("model.layers.1.ffn.gate.bias", 1) == ("tensor", ("FFN_EXP_PROBS_B", ".bias", 1))
    assert conv.classify("model.layers.2.ffn.experts.7.w2.weight", 1) == ("expert", (2, 7, "FFN_DOWN_EXP"))
    with pytest.raises(ValueError, match=r"no llama\.cpp name"):
        conv.classify("model.layers.2.attn.something_new", 1)


def test_llama_cpp_geometry_is_checked() -> None:
    with pytest.raises(SystemExit, match=r"compress rates \[16\].*hc_mult 2"):
        conv.check_geometry(_config())
    cfg = _config() | {"hc_mult": 4}
    cfg["compress_rates"] = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    assert conv.check_geometry(cfg) == [0, 4, 128, 4]


def test_vocabulary_and_special_tokens() -> None:
    vocab = conv.read_vocab(BUNDLED, _config()["vocab_size"])
    tok = json.loads((BUNDLED / "tokenizer.json").read_text())
    added = {t["id"]: t for t in tok["added_tokens"]}
    assert len(vocab["tokens"]) == _config()["vocab_size"] == len(tok["model"]["vocab"]) + 4
    for text, i in tok["model"]["vocab"].items():
        assert vocab["tokens"][i] == text
    for i, t in added.items():  # DeepSeek-V4's single tokens that are not special: user-defined
        assert vocab["tokens"][i] == t["content"]
        assert vocab["types"][i] == (conv.CONTROL if t["special"] else conv.USER_DEFINED)
    plain = {ty for i, ty in enumerate(vocab["types"]) if i not in added}
    assert [vocab["types"][i] for i in range(5)] == [conv.CONTROL] * 5 and plain == {conv.NORMAL}
    assert vocab["special"] == {"bos": 0, "eos": 1, "pad": 2}
    assert vocab["add_bos"] is True  # the post-processor puts BOS in front
    assert len(vocab["merges"]) == len(tok["model"]["merges"]) and all(" " in m for m in vocab["merges"])
    assert "<｜Assistant｜>" in vocab["chat_template"]


def test_our_pre_tokenizer_is_the_gpt2_split() -> None:
    """llama.cpp's gpt-2 pre-tokenizer splits by this regex (src/llama-vocab.cpp, with its own handling
    of trailing whitespace, which is the \\s+ alternative HF adds); ours must split the same."""
    regex = pytest.importorskip("regex")
    from tokenizers import Tokenizer

    gpt2 = regex.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
    pre = Tokenizer.from_file(str(BUNDLED / "tokenizer.json")).pre_tokenizer
    byte_of = {c: b for b, c in _bytes_to_unicode().items()}
    for text in conv.tokenizer_check_texts(BUNDLED):
        ours = [bytes(byte_of[c] for c in piece).decode("utf-8") for piece, _ in pre.pre_tokenize_str(text)]
        assert ours == gpt2.findall(text), text[:40]


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def test_run_peers_starts_llama_server_on_the_converted_file(tmp_path: Path) -> None:
    ckpt = tmp_path / "bench-random-v4"
    e = run_peers.engine("llama.cpp", ckpt, 8123, 1, False)
    assert e.cmd[-2:] == [str(tmp_path / "bench-random-v4.gguf"), "8123"]
    assert e.env["THREADS"] == "1" and e.model_name == "bench-random-v4"
    assert e.fields(64) == {"ignore_eos": True}
    mx = run_peers.engine("llama.cpp-mxfp4", ckpt, 8123, 1, False)
    assert mx.cmd[-2] == str(tmp_path / "bench-random-v4-mxfp4.gguf")
