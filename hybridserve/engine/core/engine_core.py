"""EngineCore: add_request / abort_request / step() -> token outputs. No asyncio, no HTTP, no text."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridserve.cache.coordinator import KvCacheCoordinator
from hybridserve.cache.pool_set import BlockPoolSet
from hybridserve.config import EngineConfig
from hybridserve.distributed.group import GroupAddress, ProcessGroup, init_group
from hybridserve.engine.core.scheduler import Scheduler, SchedulerOutput
from hybridserve.engine.core.stop import StopChecker
from hybridserve.engine.errors import EngineDeadError, RequestRejected
from hybridserve.engine.limits import RequestLimits
from hybridserve.engine.outputs import EngineCoreOutput
from hybridserve.engine.request import FinishReason, Request
from hybridserve.engine.sample.ops import SampleResult
from hybridserve.engine.sample.rejection_sampler import Verified
from hybridserve.engine.sample.sampler import Sampler
from hybridserve.engine.sample.structured_outputs import StructuredOutputs
from hybridserve.engine.spec_decode.control import DraftController, StepCost
from hybridserve.engine.spec_decode.decoder import SpecDecoder
from hybridserve.engine.stats import ArenaUsage, EngineSnapshot, EngineStats, PoolUsage
from hybridserve.engine.worker.cache_plan import plan_cache
from hybridserve.engine.worker.compile_policy import CompilePolicy
from hybridserve.engine.worker.model_runner import ModelRunner
from hybridserve.engine.worker.prompt_logprobs import prompt_logprobs_of
from hybridserve.kv_transfer.records import KvHandoff
from hybridserve.kv_transfer.roles import DecodeRole, PrefillRole, build_role
from hybridserve.kv_transfer.transfer_group import PlanFingerprint
from hybridserve.layers.hyper_connection import set_compile
from hybridserve.layers.parallel_experts import (
    DraftCollectives,
    ExpertShard,
    draft_moe,
    parallel_experts,
    run_dummy_moe,
)
from hybridserve.models.registry import load_model, read_config

log = logging.getLogger("hybridserve.engine")

# A step that fails this many times in a row means the engine itself is broken, not one request.
MAX_CONSECUTIVE_STEP_FAILURES = 8


class EngineCore:
    def __init__(self, config: EngineConfig, own_process: bool = False) -> None:
        """``own_process``: the engine core runs in a process of its own (``run_engine_core``), which
        starts the grammar warm-up itself once it is ready."""
        self.config = config
        self.device = config.torch_device()
        raw = read_config(config.model)
        self.dtype = config.torch_dtype(raw.get("dtype") or raw.get("torch_dtype"))
        self.group = self._join_group()
        shard = ExpertShard(self.group) if self.group is not None else None
        self.model = load_model(
            config.model,
            self.dtype,
            self.device,
            not config.dequantize_weights,
            config.native_fp8_matmul,
            shard=shard,
        )
        # found once: snapshots read them every step
        self.parallel_experts = parallel_experts(self.model.modules())
        self.plan = plan_cache(config, self.model, self.device)
        self.plan.check_usable()
        self.pools = BlockPoolSet(self.plan, self.device)
        self.coordinator = KvCacheCoordinator(
            self.plan, self.pools, config.enable_prefix_caching, hash_salt=self._cache_salt()
        )
        info = self.model.info
        self.max_model_len = config.max_model_len or info.max_position_embeddings
        self.limits = RequestLimits(info.vocab_size, self.max_model_len, self.plan.max_request_tokens())
        self.eos_token_ids = _eos_token_ids(Path(config.model), info.eos_token_ids)
        self.structured = StructuredOutputs(config.model, info.vocab_size, self.eos_token_ids)
        # an engine-core process of its own warms it up after it is ready (``process.py``)
        self.grammar_warm_up = None if own_process else self.structured.start_warm_up()
        stop = StopChecker(self.structured, self.limits.max_request_tokens)
        self.scheduler = Scheduler(self.coordinator, config.scheduler_config, stop)
        self.runner = self._build_runner()
        self.spec = self._build_spec_decoder()
        self.draft_collectives = self._draft_collectives()
        self._step_start = 0.0
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self.role = build_role(
            config.disaggregation_config,
            self.coordinator,
            self.scheduler,
            lambda: PlanFingerprint.of(self.plan, config.model, self.dtype, config.kv_cache_dtype),
            self.device,
        )
        self._early: list[EngineCoreOutput] = []  # outputs made between steps (imported first tokens)
        if self.spec is not None and self.spec.window_tokens is not None and self.role is None:
            # A prefix hit need not find the MTP window's blocks (plain steps leave them unwritten): the
            # request drafts once it rewrote a window's worth. Not where a request's rows travel to
            # another worker (disaggregation), which would not know they are unwritten.
            self.coordinator.rebuildable = frozenset({self.spec.draft_group})

    def _build_runner(self) -> ModelRunner:
        """The worker, with what its compile policy (engine/worker/compile_policy.py) chose. With
        --speculative-config engine/spec_decode/decoder.py runs every step: a decode step, or one that
        verifies up to k drafts per request, takes a decode graph (which then keeps its streams for the MTP
        layer); others take the prefill graph."""
        spec = self.config.speculative
        speculative = spec is not None
        policy = CompilePolicy.choose(
            self.config.compile_config, self.device, self.group is not None, self.model.info, speculative
        )
        set_compile(False)  # the runner's warm-up switches the compiled tail on once it is compiled
        return ModelRunner(
            self.model,
            self.pools,
            self.coordinator,
            Sampler(self.config.seed, self.structured),
            self.device,
            policy,
            max_num_seqs=self.config.max_num_seqs,
            max_model_len=self.max_model_len,
            keep_streams=speculative,
            tokens_per_request=1 + (spec.num_speculative_tokens if spec is not None else 0),
        )

    def _join_group(self) -> ProcessGroup | None:
        if not self.config.expert_parallel:
            return None
        port = self.config.data_parallel_rpc_port
        assert port is not None, "the engine-core client picks the rendezvous port"
        address = GroupAddress(self.config.data_parallel_address, port)
        rank, size = self.config.data_parallel_rank, self.config.data_parallel_size
        return init_group(address, rank, size, self.device)

    def warmup(self, progress: Callable[[str], None] | None = None) -> None:
        """Compile (and on CUDA capture) the worker's graphs before the first request (see
        ``ModelRunner.warmup``)."""
        self.runner.warmup(progress)

    @property
    def compiles_in_background(self) -> bool:
        """Whether steps start eagerly while the graphs compile beside them (``--compile-in-background``,
        on CPU, where there is something to compile), rather than after ``warmup``."""
        background = self.config.compile_in_background and self.device.type == "cpu"
        return background and self.runner.warmup_part_count() > 0

    def execute_dummy_batch(self) -> None:
        """A step with no tokens of this rank's own: joins every MoE layer's dispatch and combine."""
        run_dummy_moe(self.model.layers, self.model.info.hidden_size, self.device, self.dtype)
        if self.draft_collectives is not None:
            self.draft_collectives.begin()
            self.draft_collectives.complete()

    def _draft_collectives(self) -> DraftCollectives | None:
        """Expert-parallel speculation: every rank runs the MTP layer's MoE k times each step."""
        moe = draft_moe(self.model.modules(), self.model.layers)
        if self.group is None or self.spec is None or moe is None:
            return None
        return DraftCollectives(moe, self.spec.k, self.model.info.hidden_size, self.device, self.dtype)

    def _build_spec_decoder(self) -> SpecDecoder | None:
        spec = self.config.speculative
        if spec is None:
            return None
        k = spec.num_speculative_tokens
        control = DraftController(k, spec.adaptive, spec.disable_by_batch_size)
        return SpecDecoder(self.model, self.pools, self.coordinator, self.runner, self.device, k, control)

    def _cache_salt(self) -> bytes:
        """Prefix hashes name the cache dtype: blocks of one representation never match another's."""
        return f"kv:{self.config.kv_cache_dtype}:{self.dtype}".encode()

    @property
    def max_request_tokens(self) -> int:
        """Longest prompt + output a request may ask for: the model's and the pools' limits."""
        return self.limits.max_request_tokens

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.validate(request)
        request.max_tokens = request.params.max_tokens or self.max_request_tokens - len(
            request.prompt_token_ids
        )
        request.eos_token_ids = self.eos_token_ids
        self.structured.add_request(request)
        self.requests[request.request_id] = request
        if request.remote_prefill is not None:
            self._import(request)
        else:
            self.scheduler.add(request)

    def _import(self, req: Request) -> None:
        """Decode worker: emit the first token the prefill worker sampled, then pull its blocks."""
        remote = req.remote_prefill
        assert remote is not None
        if not isinstance(self.role, DecodeRole) and remote.handoff is not None:
            del self.requests[req.request_id]
            raise RequestRejected(
                "this server is not a decode worker (--disaggregation-mode decode)", param=None
            )
        req.num_cached_tokens = remote.num_cached_tokens
        req.output_token_ids.append(remote.first_token)
        reason, stop = remote.finish_reason, remote.stop_reason
        if reason is None:
            reason, stop = self.scheduler.stop.check(req, remote.first_token)
        logprobs = [remote.first_logprobs] if remote.first_logprobs is not None else None
        self._early.append(
            EngineCoreOutput(
                req.request_id, [remote.first_token], logprobs, reason, stop, req.num_cached_tokens
            )
        )
        if reason is not None or remote.handoff is None:
            self.finish_request(req.request_id, reason or FinishReason.STOP, stop)
        elif isinstance(self.role, DecodeRole):
            self.role.add(req)

    def validate(self, request: Request) -> None:
        """Raise RequestRejected if ``request`` can never be served as asked."""
        if request.request_id in self.requests:
            raise RequestRejected(f"request id {request.request_id!r} is already in use", param=None)
        self.limits.check(request.prompt_token_ids, request.params)
        if request.params.structured_outputs is not None:
            self.structured.compile(request.params.structured_outputs)

    def abort_request(self, request_id: str) -> bool:
        """Finish a request now and free its blocks; False if it is unknown or already done."""
        return self.finish_request(request_id, FinishReason.ABORT)

    def finish_request(
        self, request_id: str, reason: FinishReason, stop_reason: int | str | None = None
    ) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return isinstance(self.role, PrefillRole) and self.role.release(request_id)
        req.finish(reason, stop_reason)
        if isinstance(self.role, DecodeRole):
            self.role.cancel(request_id)
        self.scheduler.finish(req)
        self._count_finish(reason)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._early)

    @property
    def handoff_busy(self) -> bool:
        """A KV handoff is under way (held blocks, queued or running transfers): keep polling."""
        return self.role is not None and self.role.busy

    @property
    def handoff_events(self) -> int:
        """Changes the KV handoff made to the pools so far (a new snapshot is due when it grows)."""
        return self.role.events if self.role is not None else 0

    # ---- stepping ----------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """Run one step. A failure inside the forward or the sampler fails only that step's requests
        (finish reason ERROR, blocks freed); EngineDeadError when the engine itself cannot go on. While
        the graphs compile in the background, the compile pauses for the step (``CompileShare``)."""
        with self.runner.compile_share.step():
            return self._step()

    def _step(self) -> list[EngineCoreOutput]:
        self._step_start = time.perf_counter()  # load control times whole steps, scheduling included
        early = self._between_steps()
        out = self.scheduler.schedule()
        if not out.scheduled:
            return early
        self.stats.steps += 1
        if self.spec is not None:
            return early + self._spec_step(out, self.spec)
        return early + self._plain_step(out)

    def _plain_step(self, out: SchedulerOutput) -> list[EngineCoreOutput]:
        try:
            results = iter(self.runner.execute(out))
        except Exception as exc:
            return self._isolate(out, exc)
        self.stats.consecutive_failures = 0
        outputs: list[EngineCoreOutput] = []
        for s in out.scheduled:
            req = s.request
            req.num_computed_tokens = s.end
            self.coordinator.publish(req.request_id, req.all_token_ids, s.end)
            if s.samples:
                outputs.append(self._append_token(req, next(results)))
        return outputs

    def _isolate(self, out: SchedulerOutput, exc: Exception) -> list[EngineCoreOutput]:
        """A failed step of several requests runs again one request at a time, so that only requests whose
        own step fails are failed: one bad request never takes its batch-mates down. Safe because nothing
        is committed before the step succeeds (a rerun writes the same KV slots again). Not with expert
        parallelism: the ranks' collectives must pair up, so there a failed step is fatal anyway."""
        if len(out.scheduled) == 1 or self.group is not None:
            return self._fail_step(out, exc)
        log.warning("a step of %d requests failed (%s); running each alone", len(out.scheduled), exc)
        outputs: list[EngineCoreOutput] = []
        for s in out.scheduled:
            outputs += self._plain_step(SchedulerOutput(scheduled=[s]))
        return outputs

    def _between_steps(self) -> list[EngineCoreOutput]:
        """Outputs made since the last step, and the KV handoff's progress (failed imports end here)."""
        self.poll_handoff()
        early, self._early = self._early, []
        return early

    def poll_handoff(self) -> None:
        """Progress the KV handoff without a forward (no collectives): arrived imports join the
        scheduler, failed ones finish with an error in the next step's outputs."""
        for request_id, error in self.role.poll() if self.role is not None else []:
            if self.finish_request(request_id, FinishReason.ERROR):
                self._early.append(
                    EngineCoreOutput(
                        request_id, [], None, FinishReason.ERROR, error=error, handoff_failed=True
                    )
                )

    def _spec_step(self, out: SchedulerOutput, spec: SpecDecoder) -> list[EngineCoreOutput]:
        """Verify, commit the accepted tokens, roll back the rest, draft; see engine/spec_decode/decoder.py.

        Load control (engine/spec_decode/control.py) picks the drafts per request, or a plain step: one
        with no drafts to verify runs as the plain engine's would, leaving the MTP window rows of its
        positions unwritten (unless it is a timing try: then they are written after it is timed)."""
        start, running = self._step_start, len(self.scheduler.running)
        ready = sum(1 for s in out.scheduled if s.samples and spec.window_ready(s.request))
        choice = spec.control.choose(running, ready)
        plain = choice == 0 and self._may_run_plain(out)
        decode_only = all(s.samples and s.num_tokens == 1 + s.num_spec for s in out.scheduled)
        if self.draft_collectives is not None:
            self.draft_collectives.begin()
        outputs = self._verify_and_draft(out, spec, choice, plain)
        if self.draft_collectives is not None:
            self.draft_collectives.complete()
        seconds = time.perf_counter() - start - (spec.draft_seconds if plain else 0.0)
        # filed under the load the choice was made for, which ``choose`` looks its measurements up by
        parts = (spec.trunk_seconds, spec.draft_seconds, out.num_tokens, running, choice, spec.num_drafting)
        spec.control.record_step(StepCost(seconds, *parts, plain=plain, decode_only=decode_only))
        return outputs

    def _may_run_plain(self, out: SchedulerOutput) -> bool:
        """Decodes only, with no drafts to verify, and no expert-parallel peers (whose steps must run the
        same collectives)."""
        return self.group is None and all(
            s.samples and s.num_tokens == 1 and not s.num_spec for s in out.scheduled
        )

    def _verify_and_draft(
        self, out: SchedulerOutput, spec: SpecDecoder, choice: int, plain: bool
    ) -> list[EngineCoreOutput]:
        timing_try = plain and spec.control.exploring
        try:
            samples = [s.samples for s in out.scheduled]  # before the new tokens change the answer
            verified = spec.execute(out, plain=plain, keep_streams=not plain or timing_try)
            self.stats.consecutive_failures = 0
            outputs, finished = self._commit_verified(out, samples, verified)
            done = {r.request_id for r, _, _ in finished}
            load = (len(self.scheduler.running), self.config.max_num_batched_tokens)
            drafts = [
                0
                if plain or s.request.request_id in done or not sampled or self._hands_off(s.request)
                else min(choice, spec.num_drafts(s.request, self.max_request_tokens, *load))
                for s, sampled in zip(out.scheduled, samples, strict=True)
            ]
            if plain and not timing_try:
                spec.leave_windows(out.scheduled)
            else:
                spec.propose(out.scheduled, drafts)  # a handed-off prompt's MTP window rows too
        except Exception as exc:
            for s in out.scheduled:
                s.request.drop_drafts()
            return self._fail_step(out, exc)
        for s in out.scheduled:
            req = s.request
            self.coordinator.publish(req.request_id, req.all_token_ids, req.num_computed_tokens)
        for req, reason, stop_reason in finished:
            self.finish_request(req.request_id, reason, stop_reason)
        for o in outputs:
            leaving = self.requests.get(o.request_id)
            if o.finish_reason is None and leaving is not None and self._hands_off(leaving):
                o.kv_transfer, o.finish_reason = self._hand_off(leaving), FinishReason.LENGTH
        return outputs

    def _commit_verified(
        self, out: SchedulerOutput, samples: list[bool], verified: list[Verified]
    ) -> tuple[list[EngineCoreOutput], list[tuple[Request, FinishReason, int | str | None]]]:
        """Append each request's verified tokens and truncate its blocks to what they verified.
        -> (outputs, requests to finish once the step is done: (request, reason, stop reason))."""
        results = iter(verified)
        outputs: list[EngineCoreOutput] = []
        finished: list[tuple[Request, FinishReason, int | str | None]] = []
        for s, sampled in zip(out.scheduled, samples, strict=True):
            req = s.request
            req.num_computed_tokens = s.end - s.num_spec
            if not sampled:
                continue
            output, reason = self._append_tokens(req, next(results).results)
            outputs.append(output)
            req.num_computed_tokens = req.num_tokens - 1  # the last token is not computed
            if s.num_spec:  # without drafts the step allocated no further than its one token
                self.coordinator.truncate(req.request_id, req.num_computed_tokens)
            if reason is not None:
                finished.append((req, reason, output.stop_reason))
        return outputs, finished

    def _append_tokens(
        self, req: Request, results: list[SampleResult]
    ) -> tuple[EngineCoreOutput, FinishReason | None]:
        """Append verified tokens up to the first that ends the request (EOS, stop token, length)."""
        update = self.scheduler.append_tokens(req, results)
        self.stats.generation_tokens += len(update.tokens)
        output = EngineCoreOutput(
            req.request_id,
            update.tokens,
            update.logprobs or None,
            update.reason,
            update.stop_reason,
            req.num_cached_tokens,
            kv_handoff_seconds=_take_handoff_seconds(req),
        )
        if len(req.output_token_ids) == len(update.tokens):  # the request's first tokens
            output.prompt_logprobs = prompt_logprobs_of(req)
        return output, update.reason

    def _fail_step(self, out: SchedulerOutput, exc: Exception) -> list[EngineCoreOutput]:
        log.exception("an engine step failed; failing its %d requests", len(out.scheduled))
        self.stats.failed_steps += 1
        self.stats.consecutive_failures += 1
        message = f"the engine step running this request failed: {type(exc).__name__}: {exc}"
        failed = []
        for s in out.scheduled:
            if self.finish_request(s.request.request_id, FinishReason.ERROR):
                failed.append(
                    EngineCoreOutput(s.request.request_id, [], None, FinishReason.ERROR, error=message)
                )
        try:
            self.pools.check_integrity()
        except AssertionError as broken:
            raise EngineDeadError(f"the KV pools are inconsistent after a failed step: {broken}") from exc
        if self.stats.consecutive_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            raise EngineDeadError(f"{self.stats.consecutive_failures} engine steps failed in a row") from exc
        return failed

    def _append_token(self, req: Request, res: SampleResult) -> EngineCoreOutput:
        update = self.scheduler.append_tokens(req, [res])
        self.stats.generation_tokens += 1
        reason, handoff = update.reason, None
        if reason is None and self._hands_off(req):
            handoff, reason = self._hand_off(req), FinishReason.LENGTH
        elif reason is not None:
            self.finish_request(req.request_id, reason, update.stop_reason)
        out = EngineCoreOutput(
            req.request_id,
            update.tokens,
            update.logprobs or None,
            reason,
            update.stop_reason,
            req.num_cached_tokens,
            kv_transfer=handoff,
            kv_handoff_seconds=_take_handoff_seconds(req),
        )
        if len(req.output_token_ids) == 1:
            out.prompt_logprobs = prompt_logprobs_of(req)
        return out

    def _hands_off(self, req: Request) -> bool:
        """Prefill worker: ``req`` leaves for a decode worker once it has its first token."""
        return req.remote_decode and isinstance(self.role, PrefillRole)

    def _hand_off(self, req: Request) -> KvHandoff:
        assert isinstance(self.role, PrefillRole)
        del self.requests[req.request_id]
        req.finish(FinishReason.LENGTH)
        return self.role.hand_off(req)

    def _count_finish(self, reason: FinishReason) -> None:
        self.stats.finished[reason.value] = self.stats.finished.get(reason.value, 0) + 1

    def reset_prefix_cache(self) -> None:
        self.coordinator.reset_prefix_cache()

    def snapshot(self) -> EngineSnapshot:
        s = self.scheduler
        held = self.pools.pages_held
        kv_blocks = {
            n: PoolUsage(p.num_used, p.plan.usable_blocks, p.num_cached, p.num_evicted, held(n))
            for n, p in self.pools.pools.items()
        }
        return EngineSnapshot(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            kv_blocks=kv_blocks,
            arena=self._arena_usage(),
            prompt_tokens=s.prompt_tokens,
            prefix_hit_tokens=s.prefix_hit_tokens,
            num_preemptions=s.num_preemptions,
            generation_tokens=self.stats.generation_tokens,
            steps=self.stats.steps,
            failed_steps=self.stats.failed_steps,
            steps_by_path=dict(self.runner.steps_by_path),
            drafts_by_path=dict(self.runner.drafts_by_path),
            compiled_ready_s=dict(self.runner.graphs.ready_after),
            full_speed_s=self.runner.graphs.full_speed_after,
            dp_rank=self.config.data_parallel_rank,
            expert_tokens=self._expert_tokens(),
            collective_s=sum(e.comm_s for e in self.parallel_experts),
            handoff=self.role.stats if self.role is not None else None,
            **self._spec_snapshot(),
        )

    def _arena_usage(self) -> ArenaUsage | None:
        arena = self.pools.arena
        if arena is None:
            return None
        a = arena.plan
        return ArenaUsage(a.page_bytes, a.usable_pages, arena.num_free, arena.num_parked, arena.num_reclaimed)

    def _expert_tokens(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for experts in self.parallel_experts:
            for i, n in enumerate(experts.tokens_per_expert):
                counts[experts.range.start + i] = counts.get(experts.range.start + i, 0) + n
        return counts

    def _spec_snapshot(self) -> dict[str, Any]:
        if self.spec is None:
            return {}
        st = self.spec.stats
        return {
            "spec_num_drafts": st.num_drafts,
            "spec_num_draft_tokens": st.num_draft_tokens,
            "spec_num_accepted_tokens": st.num_accepted_tokens,
            "spec_accepted_per_pos": list(st.accepted_per_pos),
            "spec_plain_steps": st.num_plain_steps,
        }


def _eos_token_ids(folder: Path, fallback: tuple[int, ...]) -> tuple[int, ...]:
    path = folder / "generation_config.json"
    if path.is_file():
        eos = json.loads(path.read_text()).get("eos_token_id")
        if eos is not None:
            return tuple(eos) if isinstance(eos, list) else (int(eos),)
    return fallback


def _take_handoff_seconds(req: Request) -> float | None:
    """A decode worker's import time, in the request's first output after its blocks arrived only."""
    seconds, req.kv_handoff_seconds = req.kv_handoff_seconds, None
    return seconds
