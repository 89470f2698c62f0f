"""Prometheus metrics: engine state read at scrape time, latencies recorded as requests finish."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hybridserve.engine.async_llm import AsyncLLM, RequestTiming
from hybridserve.engine.request import RequestOutput
from hybridserve.engine.stats import EngineSnapshot, HandoffStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _EngineCollector(Collector):
    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        llm = self.metrics.llm
        if llm is None:
            return
        stats = llm.stats
        yield _gauge("hybridserve_num_requests_running", "requests running in the engine", stats.num_running)
        yield _gauge("hybridserve_num_requests_waiting", "requests waiting to start", llm.num_waiting)
        used = GaugeMetricFamily("hybridserve_kv_blocks_used", "KV cache blocks in use", labels=["group"])
        total = GaugeMetricFamily("hybridserve_kv_blocks_total", "usable KV cache blocks", labels=["group"])
        cached = GaugeMetricFamily(
            "hybridserve_kv_blocks_cached", "blocks findable by prefix", labels=["group"]
        )
        evicted = CounterMetricFamily(
            "hybridserve_kv_blocks_evicted", "cached blocks evicted for reuse", labels=["group"]
        )
        for name, pool in stats.kv_blocks.items():
            used.add_metric([name], pool.used)
            total.add_metric([name], pool.total)
            cached.add_metric([name], pool.cached)
            evicted.add_metric([name], pool.evicted)
        yield from (used, total, cached, evicted)
        yield from _arena_metrics(stats)
        yield _counter("hybridserve_prompt_tokens", "prompt tokens admitted", stats.prompt_tokens)
        yield _counter("hybridserve_generation_tokens", "tokens generated", stats.generation_tokens)
        yield _counter(
            "hybridserve_prefix_cache_queries",
            "prompt tokens looked up in the prefix cache",
            stats.prompt_tokens,
        )
        yield _counter(
            "hybridserve_prefix_cache_hits",
            "prompt tokens found in the prefix cache",
            stats.prefix_hit_tokens,
        )
        yield _counter(
            "hybridserve_num_preemptions", "requests preempted for recompute", stats.num_preemptions
        )
        yield _counter("hybridserve_engine_steps", "engine steps run", stats.steps)
        yield _counter("hybridserve_engine_failed_steps", "engine steps that failed", stats.failed_steps)
        yield _steps_by_path(stats)
        yield from _compile_metrics(stats)
        if stats.handoff is not None:
            yield from _handoff_metrics(stats.handoff)
        rate = stats.prefix_hit_tokens / stats.prompt_tokens if stats.prompt_tokens else 0.0
        yield _gauge("hybridserve_prefix_cache_hit_rate", "share of prompt tokens found cached", rate)
        yield from _rank_metrics(llm.rank_stats)
        yield from _spec_decode_metrics(stats)


def _steps_by_path(stats: EngineSnapshot) -> Metric:
    """How the model runner ran its steps: decode_graph (static decode steps: CUDA graphs, compiled or
    eager), prefill_graph (the compiled prefill graph), prefill_graph_refused (its guards refused the
    step, which ran eagerly on the graph's metadata), eager (the plain path)."""
    paths = CounterMetricFamily(
        "hybridserve_engine_steps_by_path", "model runner steps by how they ran", labels=["path"]
    )
    for path in ("decode_graph", "prefill_graph", "prefill_graph_refused", "eager"):
        paths.add_metric([path], stats.steps_by_path.get(path, 0))
    return paths


def _compile_metrics(stats: EngineSnapshot) -> Iterator[Metric]:
    """When each compiled part of the steps became ready, and when all were (the engine at full speed);
    until then the server runs the steps that part would take eagerly (``--compile-in-background``)."""
    ready = GaugeMetricFamily(
        "hybridserve_compiled_part_ready_seconds",
        "seconds from start-up until this compiled part of the steps was ready",
        labels=["part"],
    )
    for part, seconds in stats.compiled_ready_s.items():
        ready.add_metric([part], seconds)
    yield ready
    yield _gauge(
        "hybridserve_full_speed", "1 once every compiled step is ready", float(stats.full_speed_s is not None)
    )
    if stats.full_speed_s is not None:
        yield _gauge(
            "hybridserve_full_speed_seconds",
            "seconds from start-up until every compiled step was ready",
            stats.full_speed_s,
        )


def _arena_metrics(stats: EngineSnapshot) -> Iterator[Metric]:
    """The cache arena (--cache-layout arena): its pages and each group's share of them."""
    a = stats.arena
    if a is None:
        return
    yield _gauge("hybridserve_kv_arena_page_bytes", "bytes of one cache arena page", a.page_bytes)
    yield _gauge("hybridserve_kv_arena_pages_total", "cache arena pages groups may take", a.pages_total)
    yield _gauge("hybridserve_kv_arena_pages_free", "arena pages no group holds", a.pages_free)
    parked, reclaimed = "pages held only for cached prefixes (reclaimable)", "parked pages taken back"
    yield _gauge("hybridserve_kv_arena_pages_parked", parked, a.pages_parked)
    yield _counter("hybridserve_kv_arena_pages_reclaimed", reclaimed, a.pages_reclaimed)
    held = GaugeMetricFamily(
        "hybridserve_kv_arena_pages_held", "cache arena pages a group holds", labels=["group"]
    )
    for name, pool in stats.kv_blocks.items():
        held.add_metric([name], pool.pages)
    yield held


def _rank_metrics(ranks: dict[int, EngineSnapshot]) -> Iterator[Metric]:
    """Per data-parallel rank: its requests and pools; per routed expert (expert parallel): rows it ran."""
    running = GaugeMetricFamily(
        "hybridserve_dp_rank_num_requests_running", "requests running", labels=["rank"]
    )
    waiting = GaugeMetricFamily(
        "hybridserve_dp_rank_num_requests_waiting", "requests waiting", labels=["rank"]
    )
    used = GaugeMetricFamily(
        "hybridserve_dp_rank_kv_blocks_used", "KV cache blocks in use", labels=["rank", "group"]
    )
    total = GaugeMetricFamily(
        "hybridserve_dp_rank_kv_blocks_total", "usable KV cache blocks", labels=["rank", "group"]
    )
    experts = CounterMetricFamily(
        "hybridserve_expert_tokens",
        "token rows each routed expert ran on its rank, summed over layers",
        labels=["rank", "expert"],
    )
    handoffs = CounterMetricFamily(
        "hybridserve_dp_rank_kv_handoff_transfers", "KV handoffs the rank completed", labels=["rank"]
    )
    handoff_seconds = CounterMetricFamily(
        "hybridserve_dp_rank_kv_handoff_seconds", "the rank's handoffs, pull to completion", labels=["rank"]
    )
    for rank, s in sorted(ranks.items()):
        running.add_metric([str(rank)], s.num_running)
        waiting.add_metric([str(rank)], s.num_waiting)
        for name, pool in s.kv_blocks.items():
            used.add_metric([str(rank), name], pool.used)
            total.add_metric([str(rank), name], pool.total)
        for expert, n in sorted(s.expert_tokens.items()):
            experts.add_metric([str(rank), str(expert)], n)
        if s.handoff is not None:
            handoffs.add_metric([str(rank)], s.handoff.transfers)
            handoff_seconds.add_metric([str(rank)], s.handoff.seconds)
    yield from (running, waiting, used, total, experts, handoffs, handoff_seconds)


def _handoff_metrics(h: HandoffStats) -> Iterator[Metric]:
    """KV handoffs this worker sent (prefill) or received (decode), by cache group."""
    yield _counter("hybridserve_kv_handoff_transfers", "KV handoffs completed", h.transfers)
    yield _counter("hybridserve_kv_handoff_failures", "KV handoffs that failed", h.failed)
    yield _counter("hybridserve_kv_handoff_expired", "held blocks no decode worker pulled in time", h.expired)
    yield _counter("hybridserve_kv_handoff_corrupt", "KV handoffs that failed their checksums", h.corrupt)
    yield _counter("hybridserve_kv_handoff_seconds", "pull to completion, summed over handoffs", h.seconds)
    moved = CounterMetricFamily("hybridserve_kv_handoff_bytes", "KV bytes moved", labels=["group"])
    for name, n in h.bytes_by_group.items():
        moved.add_metric([name], n)
    yield moved


def _spec_decode_metrics(stats: EngineSnapshot) -> Iterator[Metric]:
    """vLLM's spec_decode counters (present, at zero, when speculation is off)."""
    yield _counter("hybridserve_spec_decode_num_drafts", "draft sequences verified", stats.spec_num_drafts)
    yield _counter(
        "hybridserve_spec_decode_num_draft_tokens", "draft tokens verified", stats.spec_num_draft_tokens
    )
    yield _counter(
        "hybridserve_spec_decode_num_accepted_tokens", "draft tokens accepted", stats.spec_num_accepted_tokens
    )
    yield _counter(
        "hybridserve_spec_decode_plain_steps",
        "steps a speculative engine ran without its drafter (load control chose no drafts)",
        stats.spec_plain_steps,
    )
    forwards = CounterMetricFamily(
        "hybridserve_spec_decode_draft_forwards_by_path",
        "MTP layer forwards that drafted: through a compiled draft graph, or eager",
        labels=["path"],
    )
    for path in ("graph", "eager"):
        forwards.add_metric([path], stats.drafts_by_path.get(path, 0))
    yield forwards
    per_pos = CounterMetricFamily(
        "hybridserve_spec_decode_num_accepted_tokens_per_pos",
        "draft tokens accepted at each draft position",
        labels=["position"],
    )
    for pos, n in enumerate(stats.spec_accepted_per_pos):
        per_pos.add_metric([str(pos)], n)
    yield per_pos


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.llm: AsyncLLM | None = None
        self.registry.register(_EngineCollector(self))
        self.ttft = Histogram(
            "hybridserve_time_to_first_token_seconds",
            "time to first token",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "hybridserve_inter_token_latency_seconds",
            "time between output chunks",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "hybridserve_e2e_request_latency_seconds",
            "arrival to last token",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.finished = Counter(
            "hybridserve_requests_finished", "finished requests", ["finish_reason"], registry=self.registry
        )
        self.rejected = Counter(
            "hybridserve_requests_rejected", "requests refused", ["status"], registry=self.registry
        )

    def attach(self, llm: AsyncLLM) -> None:
        self.llm = llm
        llm.on_finish.append(self.observe)

    def observe(self, out: RequestOutput, timing: RequestTiming | None) -> None:
        self.finished.labels(out.outputs[0].finish_reason or "unknown").inc()
        if timing is None or timing.first_token is None or timing.last_token is None:
            return
        self.ttft.observe(timing.first_token - timing.arrival)
        self.e2e.observe(timing.last_token - timing.arrival)
        for gap in timing.token_gaps:
            self.itl.observe(gap)

    def render(self) -> bytes:
        return generate_latest(self.registry)
