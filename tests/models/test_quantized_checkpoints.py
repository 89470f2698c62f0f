"""FP8 / FP4-expert checkpoints: kept quantized in memory with logits bit-equal to dequantising at load;
a checkpoint written by an encoder made here from the format spec loads to the same tensors; bad
checkpoints get clear errors; ``hybridserve quantize`` round-trips through the loader."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hybridserve import LLM, SamplingParams
from hybridserve.cli import main
from hybridserve.layers.quantized_experts import QuantizedExperts
from hybridserve.layers.quantized_linear import QuantLinear, dense_weight
from hybridserve.models.deepseek_v4 import DeepseekV4Model, checkpoint_to_param
from hybridserve.models.loader import CheckpointError, load_model
from hybridserve.models.quantize import quantize_checkpoint
from tests.paged import PagedSequence
from tests.tiny_models import SPECS, VOCAB

MODES = ("fp8", "fp4-experts")
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


@pytest.fixture(scope="module")
def quantized(
    tiny_checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str, str], Path]:
    built: dict[tuple[str, str], Path] = {}

    def get(name: str, mode: str) -> Path:
        if (name, mode) not in built:
            out = tmp_path_factory.mktemp(f"{name}_{mode}")
            quantize_checkpoint(tiny_checkpoint(name), out, mode)
            built[(name, mode)] = out
        return built[(name, mode)]

    return get


def _weight_bytes(model: torch.nn.Module) -> int:
    return sum(t.nbytes for t in list(model.parameters()) + list(model.buffers()))


@pytest.mark.parametrize("name", ["mixed", "bf16"])
@pytest.mark.parametrize("mode", MODES)
def test_resident_quantized_logits_are_bit_equal_to_dequantising_at_load(
    quantized: Callable[[str, str], Path], name: str, mode: str
) -> None:
    folder, dtype = quantized(name, mode), getattr(torch, SPECS[name].dtype)
    resident = PagedSequence(folder, dtype, block_tokens=8)
    dense = PagedSequence(folder, dtype, block_tokens=8, keep_quantized=False)
    assert isinstance(resident.model.layers[1].attn.wq_b, QuantLinear)
    assert isinstance(resident.model.layers[1].ffn.experts, QuantizedExperts)
    assert isinstance(dense.model.layers[1].attn.wq_b, torch.nn.Linear)
    assert _weight_bytes(resident.model) < _weight_bytes(dense.model)
    ids = torch.randint(3, VOCAB, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    for chunks in ([30], [17, 1, 1, 1, 1, 9], [1] * 12):
        n = sum(chunks)
        assert torch.equal(resident.logits(ids[:n], chunks), dense.logits(ids[:n], chunks)), chunks


def test_engine_keeps_weights_quantized_unless_asked_and_decodes_the_same(
    quantized: Callable[[str, str], Path],
) -> None:
    folder = quantized("mixed", "fp4-experts")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [
        torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 19)
    ]
    outs = []
    for dequantize in (False, True):
        llm = LLM(
            str(folder),
            block_tokens=8,
            kv_cache_memory="4MiB",
            dequantize_weights=dequantize,
            enforce_eager=True,
        )
        experts = llm.engine.model.layers[2].ffn.experts
        assert isinstance(experts, QuantizedExperts) != dequantize
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert outs[0] == outs[1]


# --- an encoder written here from the format spec, independent of hybridserve's ---


def _fp8_encode(
    w: torch.Tensor, block: int, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 with one scale per block x block tile, by default amax / 448 (the Hugging Face V3 variant)."""
    rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
    if scale is None:
        scale = torch.empty(rows, cols)
        for i in range(rows):
            for j in range(cols):
                scale[i, j] = w[i * block : (i + 1) * block, j * block : (j + 1) * block].abs().max() / 448
    r, c = torch.arange(w.shape[0])[:, None] // block, torch.arange(w.shape[1])[None, :] // block
    return (w / scale[r, c]).to(torch.float8_e4m3fn), scale


def _fp8_decode(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    r, c = torch.arange(q.shape[0])[:, None] // block, torch.arange(q.shape[1])[None, :] // block
    return (q.float() * scale[r, c]).to(torch.bfloat16)


def _fp4_encode(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e2m1 nearest value by search over the 16 codes, two per byte (element 2j in the low nibble), and
    a ue8m0 scale (biased exponent byte) per 32 values of a row."""
    groups = -(-w.shape[1] // 32)
    exps = torch.empty(w.shape[0], groups, dtype=torch.int64)
    for g in range(groups):
        amax = w[:, g * 32 : (g + 1) * 32].abs().amax(dim=1)
        exps[:, g] = torch.ceil(torch.log2(amax / 6)).long()
    scaled = w / torch.pow(2.0, exps.float())[:, torch.arange(w.shape[1]) // 32]
    codes = (scaled[..., None] - torch.tensor(E2M1)).abs().argmin(dim=-1)
    pairs = codes.view(w.shape[0], -1, 2)
    packed = (pairs[..., 0] + 16 * pairs[..., 1]).to(torch.uint8).view(torch.int8)
    return packed, (exps + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def _fp4_decode(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    b = packed.view(torch.uint8).long()
    codes = torch.stack([b % 16, b // 16], dim=-1).flatten(1)
    exps = scale.view(torch.uint8).long() - 127
    values = torch.tensor(E2M1)[codes] * torch.pow(2.0, exps.float())[:, torch.arange(codes.shape[1]) // 32]
    return values.to(torch.bfloat16)


def _spec_encoded(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    """Every linear and expert weight encoded (experts FP4, the rest FP8 in 8x8 blocks) -> the decoded
    value each weight must load to."""
    shutil.copytree(src, dst)
    tensors, expected = load_file(str(src / "model.safetensors")), {}
    for name in list(tensors):
        if not name.endswith(".weight") or tensors[name].dim() != 2 or "norm" in name or "embed" in name:
            continue
        w = tensors.pop(name).float()
        base = name.removesuffix(".weight")
        if ".ffn.experts." in name:
            tensors[name], tensors[base + ".scale"] = _fp4_encode(w)
            expected[name] = _fp4_decode(tensors[name], tensors[base + ".scale"])
        elif ".attn." in name:  # float32 scales, Hugging Face V3 naming
            tensors[name], tensors[base + ".weight_scale_inv"] = _fp8_encode(w, 8)
            expected[name] = _fp8_decode(tensors[name], tensors[base + ".weight_scale_inv"], 8)
        elif not name.endswith("gate.weight"):  # ue8m0 scales, DeepSeek V4 naming
            tensors[name], scale = _fp8_encode(w, 8)
            exps = torch.ceil(torch.log2(scale)).long()
            tensors[name] = _fp8_encode(w, 8, torch.pow(2.0, exps.float()))[0]
            tensors[base + ".scale"] = (exps + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
            expected[name] = _fp8_decode(tensors[name], torch.pow(2.0, exps.float()), 8)
        else:
            tensors[name] = w
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [8, 8]}
    (dst / "config.json").write_text(json.dumps(config))
    return expected


def _loaded(model: DeepseekV4Model, disk_name: str) -> torch.Tensor:
    param, expert, which = checkpoint_to_param(disk_name)
    path = param.rpartition(".")[0]
    module = model.get_submodule(path)
    if expert is None:
        return dense_weight(module, model.dtype)
    gate_up, down = (
        module.weights(None) if isinstance(module, QuantizedExperts) else (module.gate_up, module.down)
    )
    if which is None:
        return down[expert]
    half = gate_up.shape[1] // 2
    return gate_up[expert, :half] if which == "w1" else gate_up[expert, half:]


def test_a_checkpoint_encoded_from_the_spec_loads_to_the_same_tensors(
    tiny_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    expected = _spec_encoded(tiny_checkpoint("mixed"), tmp_path / "spec")
    assert any(".experts." in n for n in expected) and any("wo_a" in n for n in expected)
    for keep in (True, False):
        model = load_model(tmp_path / "spec", torch.float32, "cpu", keep_quantized=keep)
        for name, value in expected.items():
            assert torch.equal(_loaded(model, name), value.float()), name


# --- bad input ---


def _edited(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor], dict], None]) -> Path:
    shutil.copytree(src, dst)
    tensors, config = load_file(str(src / "model.safetensors")), json.loads((src / "config.json").read_text())
    edit(tensors, config)
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_bad_quantized_checkpoints_get_clear_errors(
    quantized: Callable[[str, str], Path], tmp_path: Path
) -> None:
    src = quantized("mixed", "fp4-experts")

    def bad_grid(t: dict[str, torch.Tensor], _: dict) -> None:
        t["model.layers.0.attn.wq_a.scale"] = torch.ones(3, 5)  # wq_a is [16, 32]

    def bad_expert_grid(t: dict[str, torch.Tensor], _: dict) -> None:
        for e in range(4):
            t[f"model.layers.1.ffn.experts.{e}.w2.scale"] = torch.ones(32, 3).to(torch.float8_e8m0fnu)

    folder = _edited(src, tmp_path / "grid", bad_grid)
    experts = _edited(src, tmp_path / "experts", bad_expert_grid)
    for keep in (True, False):
        with pytest.raises(
            CheckpointError, match=r"scale grid of shape \(3, 5\) does not tile a weight of shape \(16, 32\)"
        ):
            load_model(folder, torch.float32, "cpu", keep_quantized=keep)
        with pytest.raises(CheckpointError, match=r"does not tile a weight of shape \(32, 16\)"):
            load_model(experts, torch.float32, "cpu", keep_quantized=keep)

    def unknown_method(_: dict[str, torch.Tensor], config: dict) -> None:
        config["quantization_config"] = {"quant_method": "awq", "bits": 4}

    with pytest.raises(CheckpointError, match=r"unknown quantization method 'awq' in quantization_config"):
        load_model(_edited(src, tmp_path / "awq", unknown_method), torch.float32, "cpu")

    def no_scale(t: dict[str, torch.Tensor], _: dict) -> None:
        del t["model.layers.0.attn.wq_a.scale"]

    with pytest.raises(CheckpointError, match=r"wq_a\.weight is float8_e4m3fn but has no scale"):
        load_model(_edited(src, tmp_path / "noscale", no_scale), torch.float32, "cpu")


# --- hybridserve quantize ---


def test_quantize_writes_the_official_layout_that_loads_back(
    tiny_checkpoint: Callable[[str], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src, out = tiny_checkpoint("mixed"), tmp_path / "q"
    assert main(["quantize", "--model", str(src), "--out", str(out), "--weights", "fp4-experts"]) == 0
    assert "fp4-experts" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    }
    assert config["expert_dtype"] == "fp4" and (out / "tokenizer.json").is_file()
    with safe_open(str(out / "model.safetensors"), framework="pt") as sf:
        kinds = {n: sf.get_slice(n).get_dtype() for n in sf.keys()}  # noqa: SIM118
    assert kinds["model.layers.1.ffn.experts.0.w2.weight"] == "I8"
    assert kinds["model.layers.1.ffn.experts.0.w2.scale"] == "F8_E8M0"
    assert kinds["model.layers.1.attn.wq_b.weight"] == "F8_E4M3"
    assert kinds["model.layers.1.ffn.shared_experts.w1.weight"] == "F8_E4M3"
    assert kinds["model.layers.1.attn.compressor.wkv.weight"] == "F32"  # DeepSeek keeps these full precision
    assert kinds["model.layers.1.attn.indexer.weights_proj.weight"] == "F32"
    assert kinds["model.layers.1.ffn.gate.weight"] == "F32"
    original = load_model(src, torch.float32, "cpu")
    model = load_model(out, torch.float32, "cpu")
    for name, bound in (
        ("model.layers.1.attn.wq_b.weight", 2**-4),
        ("model.layers.2.ffn.experts.3.w1.weight", 0.25),
    ):
        ref = _loaded(original, name)
        assert (_loaded(model, name) - ref).abs().max() <= bound * ref.abs().max(), name
    assert main(["quantize", "--model", str(out), "--out", str(tmp_path / "again"), "--weights", "fp8"]) == 2
    assert "already quantized" in capsys.readouterr().err
