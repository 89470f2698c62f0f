"""``hybridserve bench soak``: thousands of mixed, hostile requests against a server with a tight pool.

It starts the server itself (so it knows the processes whose memory it watches) unless given
``--base-url`` and ``--server-pid``. Afterwards it checks what a long-running server must keep: every
pool's used blocks back to 0 (read from ``/metrics``), no 5xx but documented 503s, every answer right
(see ``soak_traffic``), preemptions and evictions actually happened, resident memory flat over the
second half within ``--rss-bound-mib``, and latency percentiles of short requests stable across the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from hybridserve.bench.server_process import descendants, parse_metrics, rss_mib, wait_healthy
from hybridserve.bench.soak_chaos import Chaos, casualty
from hybridserve.bench.soak_deploy import START_TIMEOUT_S, Deployment, add_deployment_args
from hybridserve.bench.soak_traffic import KINDS, LATENCY_KINDS, Outcome, Traffic
from hybridserve.config import default_model_path


@dataclass
class SoakReport:
    requests: int = 0
    duration_s: float = 0.0
    by_kind: dict[str, int] = field(default_factory=dict)
    by_status: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    server_errors: int = 0  # 5xx other than 503
    kv_blocks_used_after: dict[str, float] = field(default_factory=dict)
    preemptions: float = 0.0
    evictions: float = 0.0
    prefix_hit_tokens: float = 0.0
    rss_mib: list[tuple[int, float]] = field(default_factory=list)  # (requests done, server RSS)
    rss_second_half_growth_mib: float = 0.0
    latency_quarters: list[dict[str, float]] = field(default_factory=list)  # p50/p90/p99 seconds
    server_exit: int | None = None
    exits: dict[str, int] = field(default_factory=dict)  # unit -> exit status on SIGTERM at the end
    kills: list[tuple[int, int]] = field(default_factory=list)  # chaos: (requests done, worker pid)
    casualties: int = 0  # chaos: requests in flight on a killed process that failed (not wrong answers)
    restarts: dict[str, list[int]] = field(default_factory=dict)  # chaos: unit -> exit status of each death
    outlived: list[int] = field(default_factory=list)  # chaos: children that outlived their killed parent
    hangs: list[str] = field(default_factory=list)  # chaos: servers that did not exit after losing a core
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures


# ---- the server's side: its processes, its memory, its metrics -----------------------------------
def _sum(metrics: dict[str, float], name: str) -> float:
    """``name``'s values summed over labels and, for a deployment, over its units (``unit:name``)."""
    return sum(v for k, v in metrics.items() if k.partition(":")[2].startswith(name) or k.startswith(name))


async def wait_idle(client: httpx.AsyncClient, timeout: float = 60.0) -> dict[str, float]:
    """The server's metrics once nothing runs or waits and no block is used (or at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        m = parse_metrics((await client.get("/metrics")).text)
        running = m.get("hybridserve_num_requests_running", 1) + m.get("hybridserve_num_requests_waiting", 1)
        idle = running == 0
        if (idle and _sum(m, "hybridserve_kv_blocks_used") == 0) or time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.1)


# ---- the client's side ---------------------------------------------------------------------------
def _plan(requests: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    names = list(KINDS)
    return rng.choices(names, weights=[KINDS[n][0] for n in names], k=requests)


async def drive(
    args: argparse.Namespace, url: str, deployment: Deployment | None, report: SoakReport
) -> list[Outcome]:
    text = Path(default_model_path(), "heldout.txt").read_text()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=2 * args.concurrency + 4)
    timeout = httpx.Timeout(args.request_timeout)
    ready = asyncio.Event()
    ready.set()
    if deployment is not None:
        deployment.ready = ready
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        model = (await client.get("/v1/models", headers=headers)).json()["data"][0]["id"]
        roots = [text[s : s + 120] for s in (0, 3000, 7000, 11000)]
        traffic = Traffic(client, model, roots, text, args.max_body_bytes, headers)
        plan = _plan(args.requests, args.seed)
        queue: asyncio.Queue[tuple[int, str]] = asyncio.Queue()
        for item in enumerate(plan):
            queue.put_nowait(item)
        outcomes: list[Outcome] = []
        sample_every = max(1, args.requests // 40)
        chaos = Chaos(args.kill_every, args.kill_match, random.Random(args.seed))
        pids = _watched(args, deployment)

        async def worker() -> None:
            while not queue.empty():
                i, kind = queue.get_nowait()
                await asyncio.wait_for(ready.wait(), START_TIMEOUT_S + args.request_timeout)
                outcomes.append(await KINDS[kind][1](traffic, random.Random(args.seed * 1_000_003 + i)))
                if pids and len(outcomes) % sample_every == 0:
                    report.rss_mib.append((len(outcomes), round(sum(rss_mib(p) for p in pids()), 1)))
                if pids and len(outcomes) < args.requests:  # no kill after the last: survivors are judged
                    kills = len(chaos.kills)
                    chaos.after(len(outcomes), _workers(args, deployment))
                    if deployment is not None and len(chaos.kills) > kills:
                        deployment.killed()
                if deployment is not None:
                    await deployment.revive()

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        if deployment is not None:
            await deployment.revive()
        metrics = await _idle_metrics(client, deployment)
    report.kills = chaos.kills
    report.outlived = chaos.outlived() if chaos.kills else []
    report.kv_blocks_used_after = {k: v for k, v in metrics.items() if "hybridserve_kv_blocks_used" in k}
    report.preemptions = _sum(metrics, "hybridserve_num_preemptions_total")
    report.evictions = _sum(metrics, "hybridserve_kv_blocks_evicted_total")
    report.prefix_hit_tokens = _sum(metrics, "hybridserve_prefix_cache_hits_total")
    return outcomes


def _watched(args: argparse.Namespace, deployment: Deployment | None) -> Callable[[], list[int]] | None:
    """The processes whose memory is sampled (each with its descendants), or None if unknown."""
    if deployment is not None:
        return deployment.rss_pids
    return (lambda: [args.server_pid]) if args.server_pid is not None else None


def _workers(args: argparse.Namespace, deployment: Deployment | None) -> list[int]:
    """Chaos's candidates: the deployment's worker processes, or a given server's descendants."""
    if deployment is not None:
        return deployment.worker_pids()
    return descendants(args.server_pid) if args.server_pid is not None else []


async def _idle_metrics(client: httpx.AsyncClient, deployment: Deployment | None) -> dict[str, float]:
    """Every live unit's metrics once it is idle, keys prefixed with the unit (one server: unprefixed).
    A unit that goes down meanwhile (its last kill) is started again first."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            return await _units_idle(client, deployment)
        except httpx.TransportError:
            if deployment is None or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)
            await deployment.revive()


async def _units_idle(client: httpx.AsyncClient, deployment: Deployment | None) -> dict[str, float]:
    if deployment is None or deployment.router is None:
        return await wait_idle(client)
    merged: dict[str, float] = {}
    for u in deployment.live_units():
        async with httpx.AsyncClient(base_url=u.url, timeout=client.timeout) as own:
            merged |= {f"{u.name}:{k}": v for k, v in (await wait_idle(own)).items()}
    return merged


# ---- judging -------------------------------------------------------------------------------------
def _percentiles(latencies: list[float]) -> dict[str, float]:
    if len(latencies) < 2:
        return {"n": len(latencies), "p50": 0.0, "p90": 0.0, "p99": 0.0}
    q = statistics.quantiles(latencies, n=100, method="inclusive")
    return {"n": len(latencies), "p50": round(q[49], 4), "p90": round(q[89], 4), "p99": round(q[98], 4)}


def judge(report: SoakReport, outcomes: list[Outcome], args: argparse.Namespace) -> None:
    report.requests = len(outcomes)
    report.by_kind = dict(Counter(o.kind for o in outcomes))
    report.by_status = {str(k): v for k, v in sorted(Counter(o.status for o in outcomes).items())}
    cut = [o for o in outcomes if report.kills and casualty(o.status, o.problem)]
    report.casualties = len(cut)
    bad = [o for o in outcomes if o.problem and o not in cut]
    report.problems = [f"{o.kind}: {o.problem}" for o in bad[:30]]
    report.server_errors = sum(1 for o in outcomes if o.status >= 500 and o.status != 503 and o not in cut)
    short = [o.latency for o in outcomes if o.kind in LATENCY_KINDS and o.status == 200 and not o.problem]
    quarter = max(1, len(short) // 4)
    report.latency_quarters = [_percentiles(short[i * quarter : (i + 1) * quarter]) for i in range(4)]
    last_kill = max((done for done, _ in report.kills), default=0)  # restarted processes start small
    half = [rss for done, rss in report.rss_mib if done > max(report.requests // 2, last_kill)]
    report.rss_second_half_growth_mib = round(max(half) - min(half), 1) if half else 0.0
    checks = [
        (len(outcomes) == args.requests, f"{len(outcomes)} of {args.requests} requests ran"),
        (not bad, f"{len(bad)} wrong answers (first: {report.problems[:3]})"),
        (report.server_errors == 0, f"{report.server_errors} responses were 5xx other than 503"),
        (
            bool(report.kv_blocks_used_after) and not any(report.kv_blocks_used_after.values()),
            f"KV blocks still used when idle: {report.kv_blocks_used_after}",
        ),
        (report.preemptions > 0, "no preemption: the pool is not tight (lower --num-blocks)"),
        (report.evictions > 0, "no cached block was evicted: the pool is not tight"),
        (
            report.rss_second_half_growth_mib <= args.rss_bound_mib or bool(report.restarts),
            f"RSS grew {report.rss_second_half_growth_mib} MiB over the second half (> {args.rss_bound_mib})",
        ),
        (report.server_exit in (None, 0), f"the server exited {report.server_exit} on SIGTERM"),
        (not args.kill_every or bool(report.kills), f"no process matched --kill-match {args.kill_match!r}"),
        (not report.outlived, f"processes outlived their killed parent: {report.outlived}"),
        (not report.hangs, f"hangs: {report.hangs}"),
        (
            report.casualties <= 2 * args.concurrency * len(report.kills),
            f"{report.casualties} requests failed for {len(report.kills)} kills (> 2 x concurrency each)",
        ),
    ]
    for stat in ("p50", "p90") if not report.restarts else ():  # restarts leave fewer units for a while
        values = [q[stat] for q in report.latency_quarters[1:] if q["n"] > 1]
        if values and min(values) > 0:
            ratio = max(values) / min(values)
            drift = f"{stat} latency drifted x{ratio:.2f} across the run"
            checks.append((ratio <= args.latency_factor, drift))
    report.failures = [msg for ok, msg in checks if not ok]


def run_soak(args: argparse.Namespace) -> int:
    report = SoakReport()
    deployment = None
    url = args.base_url
    outcomes: list[Outcome] = []
    try:
        if url is None:
            deployment = Deployment.build(args)
            url = deployment.front_url
            deployment.start()
        else:
            wait_healthy(url)
        start = time.perf_counter()
        outcomes = asyncio.run(drive(args, url, deployment, report))
        report.duration_s = round(time.perf_counter() - start, 1)
    finally:
        if deployment is not None:
            codes = deployment.stop()
            report.server_exit = next((c for c in codes.values() if c != 0), 0)
            report.exits = codes
            report.restarts = {u.name: u.exits for u in deployment.units if u.exits}
            report.hangs = deployment.hangs
    judge(report, outcomes, args)
    out = asdict(report) | {"passed": report.passed, "command": " ".join(sys.argv)}
    print(json.dumps({k: v for k, v in out.items() if k != "rss_mib"}, indent=2))
    if args.result_json:
        Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result_json).write_text(json.dumps(out, indent=2))
    return 0 if report.passed else 1


def add_soak_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None, help="soak a running server (default: start one)")
    p.add_argument("--server-pid", type=int, default=None, help="with --base-url: the process to watch")
    p.add_argument("--model", default=None, help="model folder of the started server (default: bundled)")
    p.add_argument("--api-key", default=os.environ.get("HYBRIDSERVE_API_KEY"), help="sent as 'Bearer KEY'")
    p.add_argument("--requests", type=int, default=5000, help="requests in the soak")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    p.add_argument("--seed", type=int, default=0, help="seed of the request mix")
    p.add_argument("--num-blocks", type=int, default=24, help="started server: a tight pool")
    p.add_argument("--max-num-seqs", type=int, default=16, help="started server: running requests")
    p.add_argument("--reserve-lookahead", type=int, default=0, help="started server: 0 admits eagerly")
    p.add_argument("--max-num-batched-tokens", type=int, default=96, help="started server: step budget")
    p.add_argument("--max-body-bytes", type=int, default=65536, help="started server: body limit")
    p.add_argument("--server-arg", action="append", default=[], help="extra flag for the started server")
    p.add_argument("--request-timeout", type=float, default=120.0, help="seconds any one request may take")
    p.add_argument("--rss-bound-mib", type=float, default=64.0, help="allowed RSS growth, second half")
    p.add_argument("--latency-factor", type=float, default=2.0, help="allowed p50/p90 ratio across quarters")
    p.add_argument("--kill-every", type=int, default=0, help="chaos: SIGKILL a worker every N requests")
    p.add_argument("--kill-match", default="", help="chaos: workers are descendants whose cmdline has this")
    p.add_argument("--result-json", default=None, help="write the soak's figures to this JSON file")
    add_deployment_args(p)
