"""PNG plots of a concurrency sweep (matplotlib, an optional dependency)."""

from __future__ import annotations

from pathlib import Path

from hybridserve.bench.metrics import BenchSummary


def plot_sweep(points: list[tuple[int, BenchSummary]], folder: Path, label: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    xs = [c for c, _ in points]
    paths = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, metric in zip(axes, ("ttft_ms", "tpot_ms", "e2el_ms"), strict=True):
        for pct in ("p50", "p90", "p99"):
            ax.plot(xs, [getattr(s, metric)[pct] for _, s in points], marker="o", label=pct)
        ax.set(
            xscale="log",
            xlabel="concurrency",
            ylabel=metric.replace("_ms", " (ms)"),
            title=f"{label}: {metric}",
        )
        ax.legend()
    paths.append(folder / f"{label}_latency.png")
    fig.tight_layout()
    fig.savefig(paths[-1])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [s.output_throughput for _, s in points], marker="o", label="output tok/s")
    ax.plot(xs, [s.total_token_throughput for _, s in points], marker="o", label="total tok/s")
    ax.set(xscale="log", xlabel="concurrency", ylabel="tokens / s", title=f"{label}: throughput")
    ax.legend()
    paths.append(folder / f"{label}_throughput.png")
    fig.tight_layout()
    fig.savefig(paths[-1])
    plt.close("all")
    return paths
