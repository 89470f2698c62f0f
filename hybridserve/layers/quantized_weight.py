"""DeepSeek's quantized weight formats and their dequantisation.

FP8: ``float8_e4m3fn`` [..., out, in] with a scale grid [..., ceil(out/128), ceil(in/128)] (one scale per
128x128 block, the last block of a dimension may be partial). FP4: e2m1 codes packed two per byte
(low nibble first) [..., out, in/2] with one ue8m0 scale per 32 values along ``in``: [..., out, in/32].
Scales are float32 or ``float8_e8m0fnu`` (a power of two, stored as its biased exponent).
"""

from __future__ import annotations

import functools

import torch

FP8 = "fp8"
FP4 = "fp4"
FP8_BLOCK = 128
FP4_BLOCK = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0 = getattr(torch, "float8_e8m0fnu", None)
_FP4_DTYPES = tuple(d for d in (torch.int8, torch.uint8, getattr(torch, "float4_e2m1fn_x2", None)) if d)


def weight_format(weight: torch.Tensor) -> str:
    """FP8 or FP4, from the stored dtype; anything else has no scale to go with it."""
    if weight.dtype == torch.float8_e4m3fn:
        return FP8
    if weight.dtype in _FP4_DTYPES:
        return FP4
    raise ValueError(f"a {weight.dtype} weight cannot be dequantised (expected float8_e4m3fn or packed e2m1)")


def logical_shape(weight_shape: tuple[int, ...], fmt: str) -> tuple[int, ...]:
    """Shape of the dense weight: FP4 holds two values per stored element."""
    return (*weight_shape[:-1], weight_shape[-1] * 2) if fmt == FP4 else tuple(weight_shape)


def block_edges(weight_shape: tuple[int, ...], scale_shape: tuple[int, ...], fmt: str) -> tuple[int, int]:
    """(rows, columns) of dense weight covered by one scale, or ValueError if the grid does not tile."""
    shape = logical_shape(weight_shape, fmt)
    if len(scale_shape) != len(shape) or tuple(scale_shape[:-2]) != tuple(shape[:-2]):
        raise ValueError(
            f"a scale of shape {tuple(scale_shape)} does not fit a weight of shape {tuple(shape)}"
        )
    (out, n_in), (s_out, s_in) = shape[-2:], scale_shape[-2:]
    if fmt == FP4:
        if s_out != out:
            raise ValueError(f"an FP4 weight of {out} rows needs one scale row per weight row, not {s_out}")
        return 1, _edge(n_in, s_in, FP4_BLOCK, tuple(shape), tuple(scale_shape))
    return _edge(out, s_out, FP8_BLOCK, shape, scale_shape), _edge(n_in, s_in, FP8_BLOCK, shape, scale_shape)


def _edge(dim: int, blocks: int, default: int, shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> int:
    """DeepSeek's block (the last one may be partial), or an exact division of the dimension."""
    if blocks > 0 and -(-dim // default) == blocks:
        return default
    if blocks > 0 and dim % blocks == 0:
        return dim // blocks
    raise ValueError(
        f"a scale grid of shape {scale_shape} does not tile a weight of shape {shape}: "
        f"{blocks} blocks cannot cover a dimension of {dim}"
    )


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    if E8M0 is not None and scale.dtype == E8M0:
        return torch.pow(2.0, scale.view(torch.uint8).float() - 127)
    return scale.float()


def dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """-> bfloat16 weight of the logical shape (leading dimensions, e.g. experts, are kept)."""
    fmt = weight_format(weight)
    bo, bi = block_edges(tuple(weight.shape), tuple(scale.shape), fmt)
    # A power-of-two scale times an e4m3 or e2m1 value is exact in bfloat16, and a bfloat16 product rounds
    # the float32 one: the same bits as a float32 product rounded, at half the memory traffic.
    compute = torch.bfloat16 if E8M0 is not None and scale.dtype == E8M0 else torch.float32
    s = scale_values(scale).to(compute)
    if fmt == FP8:
        values = weight.to(compute)
    else:
        pairs = _e2m1_pairs(weight.device, compute)
        values = torch.nn.functional.embedding(weight.view(torch.uint8).int(), pairs).flatten(-2)
    return _scaled(values, s, bo, bi).to(torch.bfloat16)


def _scaled(values: torch.Tensor, s: torch.Tensor, bo: int, bi: int) -> torch.Tensor:
    """values [..., out, in] times the scale of each one's block: broadcast over whole blocks, or (a
    partial last block) the grid expanded to full size. The same products either way."""
    out, n_in = values.shape[-2:]
    if out % bo == 0 and n_in % bi == 0:
        blocks = values.unflatten(-1, (-1, bi)).unflatten(-3, (-1, bo))  # [..., so, bo, si, bi]
        return (blocks * s[..., :, None, :, None]).flatten(-4, -3).flatten(-2, -1)
    return values * s.repeat_interleave(bo, -2)[..., :out, :].repeat_interleave(bi, -1)[..., :n_in]


@functools.cache
def _e2m1_pairs(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 2]: the two values (low nibble first) of each byte, one lookup per byte. Made once per
    device, so a CUDA graph captured after a warm-up step copies nothing from the host."""
    table = torch.tensor(E2M1_VALUES, dtype=dtype)
    return torch.stack([table.repeat(16), table.repeat_interleave(16)], dim=-1).to(device)


def quantize_fp8(weight: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (float8_e4m3fn weight, ue8m0 scale per ``block`` x ``block``, the last may be partial)."""
    out, n_in = weight.shape
    w = weight.float()
    padded = torch.nn.functional.pad(w.abs(), (0, -n_in % block, 0, -out % block))
    amax = padded.unflatten(0, (-1, block)).unflatten(2, (-1, block)).amax(dim=(1, 3))
    exps = _e8m0_exponents(amax, 448.0)
    full = (
        torch.pow(2.0, exps.float()).repeat_interleave(block, 0)[:out].repeat_interleave(block, 1)[:, :n_in]
    )
    return (w / full).clamp(-448, 448).to(torch.float8_e4m3fn), _e8m0(exps)


def quantize_fp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (e2m1 codes packed two per byte, low nibble first, as int8 [out, in/2]; ue8m0 scale per
    32 values [out, ceil(in/32)]). Each value rounds to the nearest e2m1 magnitude (ties toward zero)."""
    n_in = weight.shape[-1]
    if n_in % 2:
        raise ValueError(f"FP4 packs two values per byte: {n_in} columns is odd")
    w = weight.float()
    amax = torch.nn.functional.pad(w.abs(), (0, -n_in % FP4_BLOCK)).unflatten(1, (-1, FP4_BLOCK)).amax(dim=2)
    exps = _e8m0_exponents(amax, 6.0)
    v = w / torch.pow(2.0, exps.float()).repeat_interleave(FP4_BLOCK, 1)[:, :n_in]
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    codes = torch.bucketize(v.abs().clamp(max=6.0), mids.to(v.device)) | ((v < 0).to(torch.int64) << 3)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return packed.view(torch.int8), _e8m0(exps)


def _e8m0_exponents(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """The smallest power-of-two exponent that brings ``amax`` within ``qmax`` (ue8m0's range)."""
    return torch.ceil(torch.log2(amax.clamp(min=2.0**-126) / qmax)).clamp(-127, 127).to(torch.int32)


def _e8m0(exps: torch.Tensor) -> torch.Tensor:
    biased = (exps + 127).to(torch.uint8)
    return biased.view(E8M0) if E8M0 is not None else torch.pow(2.0, exps.float())
