"""Tiny random DeepSeek-V4 checkpoints for tests, built and saved by transformers (the reference)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

VOCAB = 320
SAMPLE_TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife. Café, naïve, façade — «quotes» and emoji 🙂 and 中文字符 too. "
) * 4


@dataclass(frozen=True)
class TinySpec:
    name: str
    seed: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    csa_rate: int = 2
    hca_rate: int = 8
    sliding_window: int = 6
    index_topk: int = 3
    index_n_heads: int = 4
    hc_mult: int = 2
    dtype: str = "float32"
    extra: dict[str, Any] = field(default_factory=dict)


SPECS = {
    "mixed": TinySpec(
        "mixed",
        0,
        ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"),
        ("hash_moe", "moe", "moe"),
    ),
    "csa_heavy": TinySpec(
        "csa_heavy",
        1,
        ("compressed_sparse_attention", "heavily_compressed_attention", "compressed_sparse_attention"),
        ("hash_moe", "hash_moe", "moe"),
        csa_rate=4,
        hca_rate=4,
        sliding_window=5,
        index_topk=2,
        hc_mult=3,
    ),
    "yarn": TinySpec(
        "yarn",
        2,
        ("heavily_compressed_attention", "compressed_sparse_attention"),
        ("moe", "moe"),
        csa_rate=2,
        hca_rate=16,
        sliding_window=8,
        index_topk=4,
        hc_mult=1,
        extra={
            "rope_scaling": {
                "type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32,
                "beta_slow": 1,
            }
        },
    ),
    "bf16": TinySpec(
        "bf16",
        3,
        ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"),
        ("hash_moe", "moe", "moe"),
        dtype="bfloat16",
    ),
}


def hf_config(spec: TinySpec) -> Any:
    from transformers import DeepseekV4Config

    n = len(spec.layer_types)
    kw: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=n,
        num_attention_heads=4,
        head_dim=16,
        q_lora_rank=16,
        num_experts_per_tok=2,
        n_routed_experts=4,
        o_groups=2,
        o_lora_rank=8,
        index_n_heads=spec.index_n_heads,
        index_head_dim=8,
        index_topk=spec.index_topk,
        sliding_window=spec.sliding_window,
        compress_rates={
            "compressed_sparse_attention": spec.csa_rate,
            "heavily_compressed_attention": spec.hca_rate,
        },
        layer_types=list(spec.layer_types),
        mlp_layer_types=list(spec.mlp_layer_types),
        partial_rotary_factor=0.5,
        hc_mult=spec.hc_mult,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    kw.update({k: v for k, v in spec.extra.items() if k != "rope_scaling"})
    if "rope_scaling" in spec.extra:
        kw["rope_parameters"] = dict(spec.extra["rope_scaling"])
        kw["rope_parameters"]["rope_type"] = kw["rope_parameters"].pop("type")
    return DeepseekV4Config(**kw)


def randomise(model: Any, seed: int) -> None:
    """Give every tensor transformers initialises to 0/1 a random value so its path carries signal."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("tid2eid"):
                rows = [
                    torch.randperm(cfg.n_routed_experts, generator=g)[: cfg.num_experts_per_tok]
                    for _ in range(p.shape[0])
                ]
                p.copy_(torch.stack(rows))
            elif (
                name.endswith(("sinks", "position_bias", "e_score_correction_bias"))
                or ".base" in name
                or name.endswith("hc_base")
            ):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith((".scale", "hc_scale")) or (name.endswith(".weight") and "norm" in name):
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.3)
            elif p.dtype.is_floating_point and "inv_freq" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def make_checkpoint(spec: TinySpec, folder: Path) -> Path:
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(spec.seed)
    model = DeepseekV4ForCausalLM(hf_config(spec))
    randomise(model, spec.seed)
    model = model.to(getattr(torch, spec.dtype)) if spec.dtype != "float32" else model
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return folder


def write_tokenizer(folder: Path) -> None:
    """A byte-level BPE of VOCAB entries: pad 0, bos 1, eos 2 as the tiny configs expect."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<bos>", "<eos>", "<｜User｜>", "<｜Assistant｜>"]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([SAMPLE_TEXT], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "model_max_length": 512}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def load_reference(folder: Path, dtype: str = "float32") -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()


def add_random_mtp(src: Path, dst: Path, seed: int = 1) -> Any:
    """Copy a tiny checkpoint to ``dst`` with random ``mtp.0.*`` tensors (official layout) added.

    Returns the MTP module the tensors came from (the training code's, only used to make weights).
    """
    import shutil

    from safetensors.torch import load_file, save_file

    from hybridserve.train.mtp import MTPModule, mtp_state_to_disk

    shutil.copytree(src, dst)
    ref = load_reference(src)
    torch.manual_seed(seed)
    mtp = MTPModule(ref.config)
    randomise(mtp, seed=seed)
    tensors = load_file(str(src / "model.safetensors")) | mtp_state_to_disk(mtp)
    save_file(tensors, str(dst / "model.safetensors"))
    return mtp.eval()


# The engine's second architecture (hybridserve/models/tiny_dense.py): its checkpoints are plain tensors
# under the model's own parameter names; the tests' reference reads them with plain torch.
TINY_DENSE = dict(
    model_type="tiny_dense",
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    head_dim=8,
    intermediate_size=48,
    max_position_embeddings=512,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    torch_dtype="float32",
)


def make_tiny_dense_checkpoint(folder: Path, sliding_window: int | None, seed: int = 7) -> Path:
    """A random tiny dense checkpoint (``sliding_window`` None: full attention) with the test tokenizer."""
    import json

    from safetensors.torch import save_file

    from hybridserve.models.tiny_dense import TinyDenseConfig, TinyDenseModel

    raw = {**TINY_DENSE, "sliding_window": sliding_window}
    model = TinyDenseModel(TinyDenseConfig.from_dict(raw))
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, p in model.named_parameters():
        if "norm" in name:
            tensors[name] = 1.0 + torch.randn(p.shape, generator=g) * 0.3
        else:
            scale = 1.0 if name == "embed_tokens.weight" else 1.5 * p.shape[1] ** -0.5
            tensors[name] = torch.randn(p.shape, generator=g) * scale
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(raw))
    write_tokenizer(folder)
    return folder
