"""Cache rows kept in FP8 as DeepSeek-V4's inference code quantizes its KV (``act_quant(kv[..., :-rd],
64, "ue8m0")``): the dimensions without rope as float8_e4m3fn with a power-of-two (ue8m0) scale per 64
values, the rope dimensions in the model dtype.

A field ``f`` stored this way is three cache tensors, ``f.e4m3`` (the e4m3 bits as uint8: CPU torch has
no float8 index_copy / index_fill), ``f.scale`` (biased exponents, uint8; zeroed pages read back as
zeros) and ``f.rope``; ``write_rows`` / ``read_rows`` take either form, so
the model does not know which one the plan chose.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hybridserve.layers.gather import Rows, gather_rows, put_rows

SCALE_BLOCK = 64
NOPE, SCALE, ROPE = ".e4m3", ".scale", ".rope"
Key = tuple[str, str, str]


def fp8_widths(width: int, rope: int) -> tuple[tuple[str, int, torch.dtype | None], ...]:
    """(suffix, width, dtype; None for the model dtype) of the tensors an FP8 field of ``width`` uses."""
    n = width - rope
    return ((NOPE, n, torch.uint8), (SCALE, -(-n // SCALE_BLOCK), torch.uint8), (ROPE, rope, None))


def _part(key: Key, suffix: str) -> Key:
    return (key[0], key[1], key[2] + suffix)


def write_rows(cache: Mapping[Key, Rows], key: Key, slots: torch.Tensor, rows: torch.Tensor) -> None:
    plain = cache.get(key)
    if plain is not None:
        put_rows(plain, slots, rows)
        return
    nope = cache[_part(key, NOPE)]
    n = nope.shape[1]
    q, exps = quantize_rows(rows[:, :n])
    put_rows(nope, slots, q.view(torch.uint8))
    put_rows(cache[_part(key, SCALE)], slots, exps)
    rope = cache[_part(key, ROPE)]
    put_rows(rope, slots, rows[:, n:].to(rope.dtype))


def read_rows(cache: Mapping[Key, Rows], key: Key, index: torch.Tensor) -> torch.Tensor:
    plain = cache.get(key)
    if plain is not None:
        return gather_rows(plain, index)
    rope = gather_rows(cache[_part(key, ROPE)], index)
    codes = gather_rows(cache[_part(key, NOPE)], index).view(torch.float8_e4m3fn)
    nope = dequantize_rows(codes, gather_rows(cache[_part(key, SCALE)], index), rope.dtype)
    return torch.cat([nope, rope], dim=-1)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, n] -> (e4m3 [N, n], biased ue8m0 exponents [N, ceil(n/64)]); the last block may be partial."""
    n = x.shape[-1]
    blocks = torch.nn.functional.pad(x.float(), (0, -n % SCALE_BLOCK)).unflatten(-1, (-1, SCALE_BLOCK))
    amax = blocks.abs().amax(dim=-1).clamp(min=2.0**-126)
    exps = torch.ceil(torch.log2(amax / 448.0)).clamp(-127, 127)
    q = (blocks / torch.pow(2.0, exps)[..., None]).flatten(-2)[..., :n]
    return q.to(torch.float8_e4m3fn), (exps + 127).to(torch.uint8)


def dequantize_rows(q: torch.Tensor, exps: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    n = q.shape[-1]
    scale = torch.pow(2.0, exps.float() - 127).repeat_interleave(SCALE_BLOCK, dim=-1)[..., :n]
    return (q.float() * scale).to(dtype)


def fp8_supported(device: torch.device) -> str | None:
    """None if ``device`` can hold float8_e4m3fn tensors, else why not."""
    try:
        torch.zeros(2, device=device).to(torch.float8_e4m3fn).float()
    except (RuntimeError, TypeError) as exc:
        return str(exc).splitlines()[0]
    return None
