"""Benchmark figures in vLLM's vocabulary: throughput, TTFT, TPOT, ITL, E2EL, goodput."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from hybridserve.bench.client import RequestResult

PERCENTILES = (50, 90, 99)


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, **{f"p{p}": 0.0 for p in PERCENTILES}}
    ordered = sorted(values)
    out = {"mean": statistics.fmean(ordered)}
    for p in PERCENTILES:
        k = min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))
        out[f"p{p}"] = ordered[k]
    return out


@dataclass
class Slo:
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @classmethod
    def parse(cls, text: str | None) -> Slo:
        slo = cls()
        for part in (text or "").split(","):
            if part.strip():
                key, value = part.split("=")
                setattr(slo, f"{key.strip()}_ms", float(value))
        return slo

    def met(self, r: RequestResult) -> bool:
        return (self.ttft_ms is None or r.ttft * 1000 <= self.ttft_ms) and (
            self.tpot_ms is None or r.tpot * 1000 <= self.tpot_ms
        )


@dataclass
class BenchSummary:
    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    goodput: float | None
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2el_ms: dict[str, float]
    errors: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    spec_decode: dict[str, float] | None = None  # acceptance figures (bench/spec_decode.py), if drafted

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(
    results: list[RequestResult],
    duration: float,
    slo: Slo | None = None,
    config: dict[str, Any] | None = None,
) -> BenchSummary:
    ok = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in ok)
    total = output + sum(r.prompt_len for r in ok)
    ms = 1000.0
    good = sum(1 for r in ok if slo.met(r)) / duration if slo and (slo.ttft_ms or slo.tpot_ms) else None
    return BenchSummary(
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration,
        request_throughput=len(ok) / duration,
        output_throughput=output / duration,
        total_token_throughput=total / duration,
        goodput=good,
        ttft_ms=_stats([r.ttft * ms for r in ok]),
        tpot_ms=_stats([r.tpot * ms for r in ok if r.output_tokens > 1]),
        itl_ms=_stats([g * ms for r in ok for g in r.itl]),
        e2el_ms=_stats([r.latency * ms for r in ok]),
        errors=sorted({r.error for r in results if not r.ok})[:10],
        config=config or {},
    )


def format_table(s: BenchSummary) -> str:
    rows = [
        ("Successful requests", f"{s.completed}"),
        ("Failed requests", f"{s.failed}"),
        ("Duration (s)", f"{s.duration_s:.2f}"),
        ("Request throughput (req/s)", f"{s.request_throughput:.2f}"),
        ("Output token throughput (tok/s)", f"{s.output_throughput:.1f}"),
        ("Total token throughput (tok/s)", f"{s.total_token_throughput:.1f}"),
    ]
    if s.goodput is not None:
        rows.append(("Goodput (req/s)", f"{s.goodput:.2f}"))
    for name, d in (("TTFT", s.ttft_ms), ("TPOT", s.tpot_ms), ("ITL", s.itl_ms), ("E2EL", s.e2el_ms)):
        rows.append(
            (
                f"{name} mean / p50 / p90 / p99 (ms)",
                f"{d['mean']:.1f} / {d['p50']:.1f} / {d['p90']:.1f} / {d['p99']:.1f}",
            )
        )
    if s.spec_decode is not None:
        rows.append(("Draft acceptance rate (%)", f"{100 * s.spec_decode['acceptance_rate']:.1f}"))
        rows.append(("Mean acceptance length (tokens)", f"{s.spec_decode['mean_acceptance_length']:.2f}"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    if s.errors:
        lines.append("errors: " + "; ".join(s.errors))
    return "\n".join(lines)
