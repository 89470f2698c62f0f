"""Checkpoint folder: transformers trunk (``save_pretrained``) + ``mtp.0.*`` tensors + tokenizer files."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from transformers import DeepseekV4ForCausalLM, GenerationConfig

from hybridserve.train.mtp import MTP_PREFIX, MTPModule, mtp_state_from_disk, mtp_state_to_disk
from hybridserve.train.tokenizer import SpecialIds, save_tokenizer

WEIGHTS = "model.safetensors"
MAX_FP32_BYTES = 30_000_000


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.8
    top_p: float = 0.95


def generation_config(ids: SpecialIds, sampling: Sampling) -> GenerationConfig:
    return GenerationConfig(
        bos_token_id=ids.bos,
        eos_token_id=ids.eos,
        pad_token_id=ids.pad,
        do_sample=True,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
    )


def _merge_mtp(folder: Path, mtp: MTPModule, dtype: torch.dtype) -> None:
    path = folder / WEIGHTS
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata() or {"format": "pt"}
    tensors = load_file(str(path))
    for key, value in mtp_state_to_disk(mtp).items():
        tensors[key] = value.to(dtype) if value.is_floating_point() else value
    save_file(tensors, str(path), metadata=metadata)


def save_checkpoint(
    folder: Path,
    trunk: DeepseekV4ForCausalLM,
    mtp: MTPModule,
    tok: Tokenizer,
    ids: SpecialIds,
    sampling: Sampling = Sampling(),
) -> None:
    """Write a complete checkpoint; weights stay fp32 unless that would exceed 30 MB (then bf16)."""
    folder.mkdir(parents=True, exist_ok=True)
    n_bytes = 4 * (sum(p.numel() for p in trunk.parameters()) + sum(p.numel() for p in mtp.parameters()))
    dtype = torch.float32 if n_bytes <= MAX_FP32_BYTES else torch.bfloat16
    # a bf16 copy, never an in-place cast of the model being trained
    to_save = trunk if dtype == torch.float32 else copy.deepcopy(trunk).to(dtype)  # type: ignore[arg-type]
    to_save.save_pretrained(folder)
    _merge_mtp(folder, mtp, dtype)
    generation_config(ids, sampling).save_pretrained(folder)
    save_tokenizer(tok, folder, trunk.config.max_position_embeddings)


def load_trunk(folder: Path) -> DeepseekV4ForCausalLM:
    return DeepseekV4ForCausalLM.from_pretrained(
        folder, attn_implementation="eager", experts_implementation="eager", dtype=torch.float32
    )


def load_mtp(folder: Path, trunk: DeepseekV4ForCausalLM) -> MTPModule:
    mtp = MTPModule(trunk.config)
    with safe_open(str(folder / WEIGHTS), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k.startswith(MTP_PREFIX)}  # noqa: SIM118
    state = mtp_state_from_disk(mtp, tensors)
    mtp.load_state_dict({k: v.to(torch.float32) if v.is_floating_point() else v for k, v in state.items()})
    return mtp.eval()
