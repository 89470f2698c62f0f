"""fp32 ``F.linear`` with the weight stored row-major ([out, in], the checkpoint's layout) vs input-major
(``W.T`` contiguous, how ``load_model`` stores fp32 CPU weights), at the shapes of the bundled and the
72M checkpoints and 1-512 rows. Weights cycle through 64 MB so they are read from memory, not cache.

    python benchmarks/weight_layout.py [--threads 1]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

SHAPES = ((512, 768), (192, 320), (192, 96), (192, 4096), (512, 4096), (96, 256))  # (in, out)
ROWS = (1, 4, 16, 64, 512)


def _time(f: Callable[[], object], n: int = 100) -> float:
    for _ in range(5):
        f()
    start = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - start) / n * 1e6


def _cycle(x: torch.Tensor, weights: list[torch.Tensor]) -> Callable[[], object]:
    state = [0]

    def run() -> object:
        state[0] = (state[0] + 1) % len(weights)
        return F.linear(x, weights[state[0]])

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    torch.set_num_threads(p.parse_args().threads)
    print("| in x out | rows | row-major us | input-major us | speed-up |")
    print("|---|---|---|---|---|")
    for k, n in SHAPES:
        count = max(2, int(64e6 // (k * n * 4)))
        row_major = [torch.randn(n, k) for _ in range(count)]
        input_major = [w.t().contiguous().t() for w in row_major]
        for m in ROWS:
            x = torch.randn(m, k)
            a, b = _time(_cycle(x, row_major)), _time(_cycle(x, input_major))
            print(f"| {k} x {n} | {m} | {a:.1f} | {b:.1f} | {a / b:.2f}x |")


if __name__ == "__main__":
    main()
