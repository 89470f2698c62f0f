"""Write a GGUF that llama.cpp's ``deepseek4`` model loads, from a transformers DeepSeek-V4 checkpoint.

The llama.cpp peer is built by ``setup_llama_cpp.sh`` from the llama-cpp-python 0.3.36 source package;
its vendored converter (``convert_hf_to_gguf.py`` -> ``conversion/deepseek.py``, ``DeepseekV4Model``)
cannot read our folders: it wants DeepSeek's original tensor names without the ``model.`` prefix
(``embed.weight``, ``attn.kv_norm.weight``, ``hc_head_fn``), FP4 routed experts with e8m0 scales (which
it repacks to MXFP4), ``compress_ratios``/``num_hash_layers`` in ``config.json``, and it identifies
the pre-tokenizer by hashing the tokenizer's output on a test string, which it does not know for ours.
So this script writes the GGUF itself with the vendored ``gguf`` package, with the same metadata keys,
tensor names and shapes as ``DeepseekV4Model`` writes (the facts below come from that class and from
``src/models/deepseek4.cpp``'s ``load_arch_hparams``/``load_arch_tensors``):

* names: ``model.``-prefixed ``save_pretrained`` names map to llama.cpp's (``blk.N.attn_q_a.weight``,
  ...); our ``attn.norm`` is DeepSeek's ``attn.kv_norm`` (transformers' reverse rename is lossy); the
  routed experts of a layer are stacked into one ``[n_expert, rows, cols]`` tensor per projection; the
  hash-routing table ``tid2eid`` becomes int32; a hash layer's ``gate.bias`` and the MTP block
  (``mtp.*``) are left out, as the vendored converter does by default;
* every tensor keeps its shape (transformers stores DeepSeek's layout: ``[out, in]`` weights,
  ``ape`` as ``[ratio, width]``, ``hc_*_fn`` as ``[mix, hc*hidden]``) and its f32 values; routed experts
  are written ``--experts f32`` (default: exactly the reference's weights, so greedy agreement can be
  checked), ``f16``, or ``mxfp4`` (what llama.cpp runs for DeepSeek's own FP4 experts; quantised here
  with gguf's MXFP4 reference quantiser, so this variant is lossy);
* geometry llama.cpp accepts: compress ratios 0/4/128 only and hc_mult 4 (``GGML_ASSERT(hc == 4)``),
  sqrtsoftplus scoring, plain (non-YaRN) RoPE in our checkpoints; anything else is refused here with
  the reason, before writing (the bundled austen-v4 model: HCA 16, hc_mult 2, is refused);
* tokenizer: ``tokenizer.ggml.model = gpt2`` (byte-level BPE: vocab, merges, special tokens as
  CONTROL) with ``tokenizer.ggml.pre = gpt-2``: our tokenizer.json is a ``ByteLevel`` pre-tokenizer
  with ``use_regex`` and no normaliser, i.e. exactly the GPT-2 split regex that llama.cpp's ``gpt-2``
  pre-tokenizer applies. ``--check-tokenizer LLAMA_TOKENIZE`` proves it on the written file: it runs
  the vendored ``llama-tokenize`` on a set of texts (ASCII, whitespace runs, digits, contractions,
  non-Latin, emoji, special tokens, a rendered chat prompt, held-out book text) and compares its ids
  with the ``tokenizers`` library's, text by text. BOS is added (``add_bos_token``) as our post-
  processor does; the chat template is the checkpoint's.

    benchmarks/peers/build/llama.cpp/venv/bin/python benchmarks/peers/llama_cpp_convert.py \\
        data/bench-random-v4 data/bench-random-v4.gguf [--experts f32|f16|mxfp4] \\
        [--check-tokenizer benchmarks/peers/build/llama.cpp/bin/llama-tokenize]

Needs numpy, safetensors and gguf (the vendored ``gguf-py``: ``setup_llama_cpp.sh`` makes a venv with
them and ``tokenizers`` for the check); the name mapping and vocabulary code import none of them.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
VENDORED_GGUF = ROOT / "benchmarks" / "peers" / "build" / "llama.cpp" / "src" / "gguf-py"
RATE_OF_TYPE = {"sliding_attention": 0}
LLAMA_RATES = (0, 4, 128)
LLAMA_HC_MULT = 4
PRE_TOKENIZER = "gpt-2"  # llama.cpp's LLAMA_VOCAB_PRE_TYPE_GPT2: the GPT-2 split regex
# gguf.TokenType values (kept here so the vocabulary code needs no gguf import)
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5

# save_pretrained name (after "model.layers.N.") -> (gguf.MODEL_TENSOR member, suffix); the right-hand
# sides are DeepseekV4Model._map_dsv4_tensor_name's for DeepSeek's original names.
LAYER_MAP: dict[str, tuple[str, str]] = {
    "hc_attn_fn": ("HC_ATTN_FN", ".weight"),
    "hc_attn_base": ("HC_ATTN_BASE", ".weight"),
    "hc_attn_scale": ("HC_ATTN_SCALE", ".weight"),
    "hc_ffn_fn": ("HC_FFN_FN", ".weight"),
    "hc_ffn_base": ("HC_FFN_BASE", ".weight"),
    "hc_ffn_scale": ("HC_FFN_SCALE", ".weight"),
    "attn.attn_sink": ("ATTN_SINKS", ".weight"),
    "attn.wq_a.weight": ("ATTN_Q_A", ".weight"),
    "attn.wq_b.weight": ("ATTN_Q_B", ".weight"),
    "attn.q_norm.weight": ("ATTN_Q_A_NORM", ".weight"),
    "attn.wkv.weight": ("ATTN_KV", ".weight"),
    "attn.norm.weight": ("ATTN_KV_NORM", ".weight"),  # DeepSeek's attn.kv_norm
    "attn.kv_norm.weight": ("ATTN_KV_NORM", ".weight"),
    "attn.wo_a.weight": ("ATTN_OUT_A", ".weight"),
    "attn.wo_b.weight": ("ATTN_OUT_B", ".weight"),
    "attn.compressor.ape": ("ATTN_COMPRESSOR_APE", ".weight"),
    "attn.compressor.wkv.weight": ("ATTN_COMPRESSOR_WKV", ".weight"),
    "attn.compressor.wgate.weight": ("ATTN_COMPRESSOR_WGATE", ".weight"),
    "attn.compressor.norm.weight": ("ATTN_COMPRESSOR_NORM", ".weight"),
    "attn.indexer.wq_b.weight": ("INDEXER_ATTN_Q_B", ".weight"),
    "attn.indexer.weights_proj.weight": ("INDEXER_PROJ", ".weight"),
    "attn.indexer.compressor.ape": ("INDEXER_COMPRESSOR_APE", ".weight"),
    "attn.indexer.compressor.wkv.weight": ("INDEXER_COMPRESSOR_WKV", ".weight"),
    "attn.indexer.compressor.wgate.weight": ("INDEXER_COMPRESSOR_WGATE", ".weight"),
    "attn.indexer.compressor.norm.weight": ("INDEXER_COMPRESSOR_NORM", ".weight"),
    "attn_norm.weight": ("ATTN_NORM", ".weight"),
    "ffn_norm.weight": ("FFN_NORM", ".weight"),
    "ffn.gate.weight": ("FFN_GATE_INP", ".weight"),
    "ffn.gate.bias": ("FFN_EXP_PROBS_B", ".bias"),
    "ffn.gate.tid2eid": ("FFN_GATE_TID2EID", ".weight"),
    "ffn.shared_experts.w1.weight": ("FFN_GATE_SHEXP", ".weight"),
    "ffn.shared_experts.w2.weight": ("FFN_DOWN_SHEXP", ".weight"),
    "ffn.shared_experts.w3.weight": ("FFN_UP_SHEXP", ".weight"),
}
ROOT_MAP: dict[str, tuple[str, str]] = {
    "embed_tokens.weight": ("TOKEN_EMBD", ".weight"),
    "embed.weight": ("TOKEN_EMBD", ".weight"),
    "norm.weight": ("OUTPUT_NORM", ".weight"),
    "head.weight": ("OUTPUT", ".weight"),
    "lm_head.weight": ("OUTPUT", ".weight"),
    "hc_head.hc_fn": ("HC_HEAD_FN", ".weight"),
    "hc_head.hc_base": ("HC_HEAD_BASE", ".weight"),
    "hc_head.hc_scale": ("HC_HEAD_SCALE", ".weight"),
}
EXPERT_PROJ = {"w1": "FFN_GATE_EXP", "w2": "FFN_DOWN_EXP", "w3": "FFN_UP_EXP"}
_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])\.weight$")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", type=Path, help="transformers DeepSeek-V4 checkpoint folder")
    p.add_argument("dst", type=Path, help="GGUF file to write")
    p.add_argument("--experts", choices=["f32", "f16", "mxfp4"], default="f32", help="routed experts' type")
    p.add_argument(
        "--check-tokenizer",
        metavar="LLAMA_TOKENIZE",
        type=Path,
        default=None,
        help="after writing, compare llama-tokenize's ids with ours on a set of texts (exit 1 if any differ)",
    )
    p.add_argument("--check-only", action="store_true", help="skip writing; check an existing DST")
    return p.parse_args(argv)


def classify(name: str, hash_layers: int) -> tuple[str, Any]:
    """What to do with one ``save_pretrained`` tensor.

    ``("tensor", (member, suffix, bid))``: write it under ``gguf.MODEL_TENSOR[member]`` (``bid`` None for
    root tensors); ``("expert", (bid, eid, proj_member))``: one routed expert's projection, stacked per
    layer; ``("skip", reason)``; raises ValueError for a name the mapping does not know.
    """
    if name.startswith("mtp."):
        return "skip", "MTP block (the vendored converter skips it too unless --mtp)"
    m = _LAYER.match(name)
    if m is None:
        key = name.removeprefix("model.")
        if key in ROOT_MAP:
            member, suffix = ROOT_MAP[key]
            return "tensor", (member, suffix, None)
        raise ValueError(f"no llama.cpp name for tensor {name!r}")
    bid, rest = int(m.group(1)), m.group(2)
    e = _EXPERT.match(rest)
    if e is not None:
        return "expert", (bid, int(e.group(1)), EXPERT_PROJ[e.group(2)])
    if rest == "ffn.gate.bias" and bid < hash_layers:
        return "skip", "hash layer's gate.bias (hash layers route by tid2eid)"
    if rest not in LAYER_MAP:
        raise ValueError(f"no llama.cpp name for tensor {name!r}")
    member, suffix = LAYER_MAP[rest]
    return "tensor", (member, suffix, bid)


def compress_ratios(cfg: dict[str, Any]) -> list[int]:
    rates = dict(cfg.get("compress_rates") or {})
    rate_of_type = dict(RATE_OF_TYPE)
    rate_of_type["compressed_sparse_attention"] = int(rates.get("compressed_sparse_attention", 4))
    rate_of_type["heavily_compressed_attention"] = int(rates.get("heavily_compressed_attention", 128))
    layer_types = cfg.get("layer_types") or []
    if len(layer_types) != int(cfg["num_hidden_layers"]):
        raise SystemExit("config.json has no per-layer `layer_types`; save it with transformers >= 5.23")
    return [rate_of_type[t] for t in layer_types]


def hash_layer_count(cfg: dict[str, Any]) -> int:
    mlp_types = cfg.get("mlp_layer_types") or ["moe"] * int(cfg["num_hidden_layers"])
    n = 0
    while n < len(mlp_types) and mlp_types[n] == "hash_moe":
        n += 1
    if "hash_moe" in mlp_types[n:]:
        raise SystemExit("llama.cpp hash-routes the FIRST num_hash_layers layers; these are not leading")
    return n


def check_geometry(cfg: dict[str, Any]) -> list[int]:
    """The compress ratios, or SystemExit naming what llama.cpp's deepseek4 cannot run."""
    if cfg.get("model_type") != "deepseek_v4":
        raise SystemExit(f"not a DeepSeek-V4 checkpoint (model_type={cfg.get('model_type')!r})")
    ratios = compress_ratios(cfg)
    problems = []
    bad = sorted({r for r in ratios if r not in LLAMA_RATES})
    if bad:
        problems.append(f"compress rates {bad} (llama.cpp: 0, 4 and 128 only)")
    if int(cfg["hc_mult"]) != LLAMA_HC_MULT:
        problems.append(f"hc_mult {cfg['hc_mult']} (llama.cpp asserts hc_mult == 4)")
    if cfg.get("scoring_func", "sqrtsoftplus") != "sqrtsoftplus":
        problems.append(f"scoring_func {cfg['scoring_func']} (llama.cpp: sqrtsoftplus only)")
    for which, rope in (cfg.get("rope_parameters") or {}).items():
        if isinstance(rope, dict) and rope.get("rope_type", "default") != "default":
            problems.append(f"{which} rope_type {rope['rope_type']} (this converter writes plain RoPE only)")
    if problems:
        raise SystemExit("llama.cpp's deepseek4 cannot run this checkpoint: " + "; ".join(problems))
    return ratios


def rope_thetas(cfg: dict[str, Any]) -> tuple[float, float]:
    rope = cfg.get("rope_parameters") or {}
    main = float((rope.get("main") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0)))
    compress = float((rope.get("compress") or {}).get("rope_theta", cfg.get("compress_rope_theta", main)))
    return main, compress


def read_vocab(folder: Path, vocab_size: int) -> dict[str, Any]:
    """Tokens (by id), token types, merges and special ids of a byte-level BPE ``tokenizer.json``."""
    tok = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    model, pre = tok.get("model") or {}, tok.get("pre_tokenizer") or {}
    if model.get("type") != "BPE":
        raise SystemExit(f"tokenizer model {model.get('type')!r}: only byte-level BPE is handled")
    if tok.get("normalizer") is not None:
        raise SystemExit("the tokenizer has a normaliser; llama.cpp's gpt-2 pre-tokenizer does not normalise")
    if pre.get("type") != "ByteLevel" or not pre.get("use_regex", True) or pre.get("add_prefix_space"):
        raise SystemExit(
            f"pre-tokenizer {pre}: only ByteLevel(use_regex=True, add_prefix_space=False) matches "
            f"llama.cpp's gpt-2 pre-tokenizer"
        )
    vocab: dict[str, int] = dict(model["vocab"])
    added = {t["content"]: t for t in tok.get("added_tokens") or []}
    for content, t in added.items():
        vocab[content] = int(t["id"])
    n = max(vocab_size, max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [UNUSED] * n
    for text, i in vocab.items():
        tokens[i] = text
        t = added.get(text)
        types[i] = NORMAL if t is None else (CONTROL if t.get("special") else USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    cfg_path = folder / "tokenizer_config.json"
    tcfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
    special = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = tcfg.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if value is not None and value in vocab:
            special[key.removesuffix("_token")] = vocab[value]
    template = tcfg.get("chat_template")
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    post = json.dumps(tok.get("post_processor") or {}, ensure_ascii=False)
    add_bos = "bos" in special and tokens[special["bos"]] in post
    return {
        "tokens": tokens,
        "types": types,
        "merges": merges,
        "special": special,
        "add_bos": add_bos,
        "chat_template": template,
    }


def _import_gguf() -> Any:
    try:
        import gguf
    except ImportError:
        sys.path.insert(0, str(VENDORED_GGUF))
        import gguf
    if not hasattr(gguf.MODEL_ARCH, "DEEPSEEK4"):
        raise SystemExit(f"gguf {gguf.__file__} has no DEEPSEEK4: use the vendored gguf-py ({VENDORED_GGUF})")
    return gguf


def convert(src: Path, dst: Path, experts: str) -> None:
    import numpy as np
    from safetensors import safe_open

    gguf = _import_gguf()
    cfg = json.loads((src / "config.json").read_text())
    ratios = check_geometry(cfg)
    n_layers = int(cfg["num_hidden_layers"])
    n_hash = hash_layer_count(cfg)
    n_expert = int(cfg["n_routed_experts"])
    main_theta, compress_theta = rope_thetas(cfg)
    head_dim = int(cfg["head_dim"])
    rope_dim = int(cfg.get("qk_rope_head_dim") or round(head_dim * cfg["partial_rotary_factor"]))
    vocab = read_vocab(src, int(cfg["vocab_size"]))

    w = gguf.GGUFWriter(str(dst), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.DEEPSEEK4])
    w.add_name(src.name)
    w.add_block_count(n_layers)
    w.add_context_length(int(cfg["max_position_embeddings"]))
    w.add_embedding_length(int(cfg["hidden_size"]))
    w.add_head_count(int(cfg["num_attention_heads"]))
    w.add_head_count_kv(int(cfg["num_key_value_heads"]))
    w.add_rope_freq_base(main_theta)
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_expert_count(n_expert)
    w.add_expert_used_count(int(cfg["num_experts_per_tok"]))
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SQRTSOFTPLUS)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(rope_dim)
    w.add_q_lora_rank(int(cfg["q_lora_rank"]))
    w.add_sliding_window(int(cfg["sliding_window"]))
    w.add_expert_feed_forward_length(int(cfg["moe_intermediate_size"]))
    w.add_expert_shared_count(int(cfg["n_shared_experts"]))
    w.add_expert_weights_scale(float(cfg["routed_scaling_factor"]))
    w.add_expert_weights_norm(bool(cfg["norm_topk_prob"]))
    w.add_swiglu_clamp_exp([float(cfg["swiglu_limit"])] * n_layers)
    w.add_swiglu_clamp_shexp([float(cfg["swiglu_limit"])] * n_layers)
    w.add_indexer_head_count(int(cfg["index_n_heads"]))
    w.add_indexer_key_length(int(cfg["index_head_dim"]))
    w.add_indexer_top_k(int(cfg["index_topk"]))
    w.add_attention_output_group_count(int(cfg["o_groups"]))
    w.add_attention_output_lora_rank(int(cfg["o_lora_rank"]))
    w.add_attention_compress_ratios(ratios)
    w.add_attention_compress_rope_freq_base(compress_theta)
    w.add_hyper_connection_count(int(cfg["hc_mult"]))
    w.add_hyper_connection_sinkhorn_iterations(int(cfg["hc_sinkhorn_iters"]))
    w.add_hyper_connection_epsilon(float(cfg["hc_eps"]))
    w.add_hash_layer_count(n_hash)
    w.add_embedding_length_out(int(cfg["hidden_size"]) * int(cfg["hc_mult"]))
    file_type = {
        "f32": gguf.LlamaFileType.ALL_F32,
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "mxfp4": gguf.LlamaFileType.MOSTLY_MXFP4_MOE,
    }[experts]
    w.add_file_type(file_type)

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(PRE_TOKENIZER)
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["types"])
    w.add_token_merges(vocab["merges"])
    special = vocab["special"]
    for key, add in (
        ("bos", w.add_bos_token_id),
        ("eos", w.add_eos_token_id),
        ("pad", w.add_pad_token_id),
        ("unk", w.add_unk_token_id),
    ):
        if key in special:
            add(special[key])
    w.add_add_bos_token(bool(vocab["add_bos"]))
    w.add_add_eos_token(False)
    if vocab["chat_template"]:
        w.add_chat_template(vocab["chat_template"])

    def gguf_name(member: str, suffix: str, bid: int | None) -> str:
        key = getattr(gguf.MODEL_TENSOR, member)
        return gguf.TENSOR_NAMES[key].format(bid=bid) + suffix

    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"no *.safetensors in {src}")
    stacks: dict[tuple[int, str], dict[int, Any]] = {}
    written, skipped = 0, 0
    for path in files:
        with safe_open(str(path), "np") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                kind, what = classify(name, n_hash)
                if kind == "skip":
                    skipped += 1
                    continue
                data = f.get_tensor(name)
                if kind == "expert":
                    bid, eid, member = what
                    stacks.setdefault((bid, member), {})[eid] = data
                    continue
                member, suffix, bid = what
                if member == "FFN_GATE_TID2EID":
                    data = data.astype(np.int32)
                elif data.dtype != np.float32:
                    data = data.astype(np.float32)
                w.add_tensor(gguf_name(member, suffix, bid), np.ascontiguousarray(data))
                written += 1
    for (bid, member), by_eid in sorted(stacks.items()):
        if sorted(by_eid) != list(range(n_expert)):
            raise SystemExit(f"layer {bid} {member}: experts {sorted(by_eid)}, expected 0..{n_expert - 1}")
        stacked = np.stack([by_eid[e].astype(np.float32) for e in range(n_expert)])
        name = gguf_name(member, ".weight", bid)
        if experts == "f32":
            w.add_tensor(name, stacked)
        elif experts == "f16":
            w.add_tensor(name, stacked.astype(np.float16))
        else:
            q = gguf.quants.quantize(stacked, gguf.GGMLQuantizationType.MXFP4)
            w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        written += 1
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"{dst}: {written} tensors ({len(stacks)} stacked expert tensors, {experts}), {skipped} left out")


def tokenizer_check_texts(folder: Path) -> list[str]:
    texts = [
        "Hello world",
        "It is a truth universally acknowledged, that a single man in possession of a good fortune.",
        "  two leading spaces, trailing spaces   ",
        "tabs\tand\nnewlines\n\n\nand  \n  mixed   whitespace\t\t",
        "Numbers 0 1 2 3 12345 3.14159 1,000,000 and 2026-12-05.",
        "Contractions: don't, I'll, you're, we've, she'd, it's, I'm; DON'T SHOUT'S",
        "Punctuation!!! ??? ... --- ((brackets)) [x] {y} \"quoted\" 'single' `code` #tag @user",
        "café naïve façade — “curly quotes” ‘single’ … Ångström",
        "日本語のテキスト、中文文本。한국어 텍스트. Ελληνικά. Русский текст.",
        "emoji 🙂🚀 and symbols ©®™ ∑∫√ ≤≥",
        "<｜begin▁of▁sentence｜>special<｜User｜>tokens<｜Assistant｜>inline<｜end▁of▁sentence｜>",
        "<｜begin▁of▁sentence｜><｜User｜>What is the capital of France?<｜Assistant｜>",
    ]
    heldout = ROOT / "hybridserve" / "assets" / "austen-v4" / "heldout.txt"
    if heldout.is_file():
        book = heldout.read_text(encoding="utf-8")
        step = max(1, len(book) // 8)
        texts += [book[i : i + 1500] for i in range(0, len(book) - 1500, step)][:8]
    return texts


def check_tokenizer(src: Path, gguf_path: Path, llama_tokenize: Path) -> bool:
    """llama-tokenize's ids (BOS added, special tokens parsed) against ``tokenizers``' on each text."""
    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(str(src / "tokenizer.json"))
    ok = True
    texts = tokenizer_check_texts(src)
    for text in texts:
        want = ours.encode(text, add_special_tokens=True).ids
        out = subprocess.run(
            [str(llama_tokenize), "-m", str(gguf_path), "-p", text, "--ids", "--log-disable"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        got = json.loads(out.strip().splitlines()[-1])
        same = got == want
        ok &= same
        print(f"{'same' if same else 'DIFFERENT'} ({len(want)} ids): {text[:60]!r}")
        if not same:
            print(f"  ours  {want}\n  llama {got}")
    print(f"tokenizer check: {'all' if ok else 'NOT all'} {len(texts)} texts give the same ids")
    return ok


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.check_only:
        convert(args.src, args.dst, args.experts)
    if args.check_tokenizer is not None and not check_tokenizer(args.src, args.dst, args.check_tokenizer):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
