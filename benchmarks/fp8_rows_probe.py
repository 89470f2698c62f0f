"""Which row counts F.scaled_mm (blockwise 1x128 / 128x128 scales) accepts on this GPU, raw and through
hybridserve.layers.fp8_matmul.native (rows padded to ROW_ALIGN). Needs CUDA sm90+; prints one line per M.

    python3 benchmarks/fp8_rows_probe.py   # results/cuda/fp8_probe.txt: H200, torch 2.11+cu130
"""

import torch
import torch.nn.functional as F

from hybridserve.layers import fp8_matmul as fm

torch.manual_seed(0)
K, N = 512, 256
w = torch.randn(N, K, device="cuda")
blocks = w.unflatten(0, (-1, 128)).unflatten(-1, (-1, 128))
w_scale = blocks.abs().amax(dim=(1, 3)) / 448.0
wq = (blocks / w_scale[:, None, :, None]).flatten(2).flatten(0, 1).to(torch.float8_e4m3fn)
for m in (1, 2, 3, 4, 5, 7, 8, 12, 16, 17, 32, 128):
    x = torch.randn(m, K, device="cuda").bfloat16()
    xq, sx = fm.quantize_activations(x)
    try:
        F.scaled_mm(
            xq,
            wq.T,
            sx.T.contiguous().T,
            F.ScalingType.BlockWise1x128,
            w_scale.contiguous().T,
            F.ScalingType.BlockWise128x128,
            output_dtype=torch.bfloat16,
        )
        raw = "ok"
    except Exception as e:
        raw = type(e).__name__ + ": " + str(e).splitlines()[0][:80]
    try:
        y = fm.native(xq, sx, wq, w_scale, torch.bfloat16)
        ref = fm.emulated(xq, sx, wq, w_scale)
        err = float((y.float() - ref).abs().max() / ref.abs().max())
        fixed = f"ok rel err {err:.2e} shape {tuple(y.shape)}"
    except Exception as e:
        fixed = type(e).__name__ + ": " + str(e).splitlines()[0][:80]
    print(f"M={m:4d} raw: {raw:60s} padded: {fixed}", flush=True)
