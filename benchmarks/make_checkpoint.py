"""Write a larger random DeepSeek-V4 checkpoint for benchmarks (transformers ``save_pretrained``).

The model is random but not degenerate: the hash-routing table ``tid2eid`` (created all zeros by
transformers) gets a random table of distinct experts per token, and the tensors transformers
initialises to 0 or 1 (attention sinks, compressor ``position_bias``, router correction bias,
hyper-connection base/scale, RMSNorm weights) get small random values so their paths carry signal.

Shape defaults (~70M parameters): hidden 512, head_dim 128, 8 heads, 6 layers covering the three
attention types (sliding, CSA at rate 4, HCA at rate 128, as in the real model), sliding window 128,
hash MoE in the first layer then top-k MoE, 16 experts top-2, hc_mult 4.

The tokenizer comes from the bundled model (``hybridserve/assets/austen-v4``) when it exists; otherwise
a small byte-level BPE with the DeepSeek special tokens is trained here (on the bundled held-out text
if present, else on a fixed built-in text). The vocabulary of the random model is sized to the
tokenizer.

    python benchmarks/make_checkpoint.py [--out data/bench-random-v4] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "hybridserve" / "assets" / "austen-v4"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SPECIAL_TOKENS = [BOS, EOS, PAD, USER, ASSISTANT]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '<｜Assistant｜>' + message['content'] + eos_token }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)
FALLBACK_TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife. However little known the feelings or views of such a man may be on "
    "his first entering a neighbourhood, this truth is so well fixed in the minds of the surrounding "
    "families, that he is considered the rightful property of some one or other of their daughters. "
    "The quick brown fox jumps over the lazy dog. In the beginning was the Word, and the Word was with "
    "God. Numbers 0 1 2 3 4 5 6 7 8 9 and punctuation ; : ! ? ' \" ( ) [ ] { } - -- ... are here too. "
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "data" / "bench-random-v4", help="output folder")
    p.add_argument(
        "--tokenizer-from",
        type=Path,
        default=None,
        help="folder with tokenizer.json (default: the bundled model, else train a BPE)",
    )
    p.add_argument("--bpe-vocab", type=int, default=4096, help="vocab size of a BPE trained here")
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--num-heads", type=int, default=8)
    p.add_argument("--num-layers", type=int, default=6)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--moe-intermediate", type=int, default=384)
    p.add_argument("--hc-mult", type=int, default=4)
    p.add_argument("--sliding-window", type=int, default=128)
    p.add_argument("--csa-rate", type=int, default=4)
    p.add_argument("--hca-rate", type=int, default=128)
    p.add_argument("--index-topk", type=int, default=32)
    p.add_argument("--max-position", type=int, default=8192)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="saved dtype")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def layer_schedule(n: int) -> tuple[list[str], list[str]]:
    """Sliding first, then CSA/HCA alternating (all three types present for n >= 3)."""
    if n < 3:
        raise SystemExit("--num-layers must be >= 3 so that all three attention types are present")
    attn = ["sliding_attention"] + [
        "compressed_sparse_attention" if i % 2 == 0 else "heavily_compressed_attention" for i in range(n - 1)
    ]
    mlp = ["hash_moe"] + ["moe"] * (n - 1)
    return attn, mlp


def train_bpe(out: Path, vocab_size: int) -> None:
    """A small byte-level BPE with the DeepSeek special tokens (ids 0..4 in SPECIAL_TOKENS order)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    heldout = BUNDLED / "heldout.txt"
    text = heldout.read_text(encoding="utf-8") if heldout.is_file() else FALLBACK_TEXT * 50
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [line for line in text.splitlines() if line.strip()]
    tok.train_from_iterator(lines, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": BOS,
                "eos_token": EOS,
                "pad_token": PAD,
                "add_bos_token": True,
                "add_eos_token": False,
                "clean_up_tokenization_spaces": False,
                "model_max_length": 8192,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
            ensure_ascii=False,
        )
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}, indent=2, ensure_ascii=False)
    )


def install_tokenizer(out: Path, source: Path | None, bpe_vocab: int) -> str:
    """Copy or train the tokenizer into ``out``; returns where it came from."""
    if source is None and (BUNDLED / "tokenizer.json").is_file():
        source = BUNDLED
    if source is not None:
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, out / name)
        return str(source)
    train_bpe(out, bpe_vocab)
    return f"byte-level BPE trained here (vocab {bpe_vocab})"


def token_ids(out: Path) -> dict[str, int | None]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = {name: tok.token_to_id(t) for name, t in (("bos", BOS), ("eos", EOS), ("pad", PAD))}
    ids["vocab"] = tok.get_vocab_size(with_added_tokens=True)
    return ids


@torch.no_grad()
def randomise(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Fill what transformers leaves zero/one with small random values (see the module docstring)."""

    def like(t: torch.Tensor, std: float, mean: float = 0.0) -> torch.Tensor:
        return (torch.randn(t.shape, generator=generator) * std + mean).to(t.dtype)

    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind == "DeepseekV4HashRouter":
            n_tok, k = module.tid2eid.shape
            table = torch.rand(n_tok, module.num_experts, generator=generator).argsort(dim=1)[:, :k]
            module.tid2eid.copy_(table)
        elif kind == "DeepseekV4TopKRouter":
            module.e_score_correction_bias.copy_(like(module.e_score_correction_bias, 0.02))
        elif kind == "DeepseekV4Attention":
            module.sinks.copy_(like(module.sinks, 0.5))
        elif kind in ("DeepseekV4HCACompressor", "DeepseekV4CSACompressor", "DeepseekV4Indexer"):
            module.position_bias.copy_(like(module.position_bias, 0.5))
        elif kind == "DeepseekV4HyperConnection":
            module.base.copy_(like(module.base, 0.1))
            module.scale.copy_(like(module.scale, 0.1, 1.0))
        elif kind == "DeepseekV4HyperHead":
            module.hc_base.copy_(like(module.hc_base, 0.1))
            module.hc_scale.copy_(like(module.hc_scale, 0.1, 1.0))
        elif kind == "DeepseekV4RMSNorm":
            module.weight.copy_(like(module.weight, 0.1, 1.0))
        del name


def build_config(args: argparse.Namespace, ids: dict[str, int | None]) -> Any:
    from transformers import DeepseekV4Config

    layer_types, mlp_layer_types = layer_schedule(args.num_layers)
    return DeepseekV4Config(
        vocab_size=ids["vocab"],
        hidden_size=args.hidden_size,
        moe_intermediate_size=args.moe_intermediate,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=1,
        head_dim=args.head_dim,
        q_lora_rank=args.hidden_size // 2,
        partial_rotary_factor=0.25,  # rope dim 32 of 128 (the real model: 64 of 512)
        num_experts_per_tok=args.top_k,
        n_routed_experts=args.experts,
        n_shared_experts=1,
        layer_types=layer_types,
        mlp_layer_types=mlp_layer_types,
        compress_rates={
            "compressed_sparse_attention": args.csa_rate,
            "heavily_compressed_attention": args.hca_rate,
        },
        hc_mult=args.hc_mult,
        sliding_window=args.sliding_window,
        o_groups=4,
        o_lora_rank=args.hidden_size // 4,
        index_n_heads=8,
        index_head_dim=64,
        index_topk=args.index_topk,
        max_position_embeddings=args.max_position,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
        tie_word_embeddings=False,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import DeepseekV4ForCausalLM, GenerationConfig

    args.out.mkdir(parents=True, exist_ok=True)
    tok_source = install_tokenizer(args.out, args.tokenizer_from, args.bpe_vocab)
    ids = token_ids(args.out)
    config = build_config(args, ids)

    torch.manual_seed(args.seed)
    model = DeepseekV4ForCausalLM(config).eval()
    randomise(model, torch.Generator().manual_seed(args.seed + 1))
    dtype = getattr(torch, args.dtype)
    model = model.to(dtype)
    model.generation_config = GenerationConfig(
        bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"], do_sample=False
    )
    model.save_pretrained(args.out)

    n_params = sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    per_token_experts = expert * args.top_k // args.experts
    summary = {
        "out": str(args.out),
        "tokenizer": tok_source,
        "vocab_size": config.vocab_size,
        "params": n_params,
        "routed_expert_params": expert,
        "active_params_per_token": n_params - expert + per_token_experts,
        "dtype": args.dtype,
        "layer_types": config.layer_types,
        "mlp_layer_types": config.mlp_layer_types,
        "compress_rates": config.compress_rates,
    }
    print(json.dumps(summary, indent=2))
    print(f"parameters: {n_params / 1e6:.1f}M", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
