"""Per-step profile of hybridserve's decode step: aten ops per step, top ops, time per layer part.

Loads the offline engine (``LLM``) on ``--model``, puts ``--batch`` random-token requests of
``--prompt-len`` tokens into steady greedy decode (prefill first; the count starts once every request
has its first token, so every counted step is a pure decode step of the whole batch), then runs:

1. ``--warmup`` decode steps (not counted);
2. ``--timed-steps`` steps, nothing injected: wall time of ``llm.engine.step()`` per step;
3. ``--wrapped-steps`` steps with the scope wrappers installed but no profiler (their cost);
4. ``--steps`` steps under ``torch.profiler`` (CPU) with the wrappers: every aten op and every scope.

Scopes are ``torch.profiler.record_function`` regions (its fast form where torch has it) injected
from here, never by editing the package: the ``forward`` (or named method) of the model's module
classes, found by class name among ``type(m) for m in llm.engine.model.modules()``, and a few
functions (``sink_attention``, ``apply_rope``, ``build_forward_batch``, ...) replaced in every
``hybridserve.*`` module that imported them. A class, method or function a checkout lacks is
skipped and listed under ``missing`` in the JSON, so the script runs against any checkout that keeps
``LLM``, ``SamplingParams`` and ``llm.engine.step()``.

Time is attributed to the innermost scope ("exclusive"): a norm inside the attention counts as a
norm, the aten ops and the Python between them count for the scope they run in. ``inclusive`` is the
whole time under a part's scopes (attention with its norms and rope; groups: each group's outermost
scopes). The profiler adds a few microseconds per op, so profiled step times are longer than the
plain ones; use the shares, and the plain ``ms/step`` for speed.

Each step's wall time and this thread's CPU time (``time.thread_time``) are both kept. On a shared
machine the wall time includes waits for a core; CPU time does not (though a busy sibling hyperthread
still slows it), so compare runs by CPU ms/step, and by ops/step, which load does not move. A step
whose wall time exceeds its CPU time by more than ``--max-wall-over-cpu`` was preempted: phases 2-4
run until they have their count of unpreempted steps (at most 3x as many steps in all), and
preempted profiled steps are left out of the op and part tables.

    python benchmarks/profile_step.py --batch 16 --label eager \
        --out benchmarks/results/profile/eager-austen-v4-b16.json
    PYTHONPATH=/tmp/hs-before python benchmarks/profile_step.py ...   # profile another checkout
"""

from __future__ import annotations

import argparse
import functools
import gc
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

SCOPE = "hs::"
STEP_PART = "engine/schedule+bookkeeping"

# What each part's exclusive time holds (printed under the tables and kept in the JSON).
PART_NOTES = {
    STEP_PART: "engine.step() outside the runner: scheduling, appending tokens, stop checks, publish",
    "engine/runner": "ModelRunner.execute outside its calls: picking logits rows, the sampling list",
    "batch/forward_batch": "build_forward_batch: token ids, positions, block tables to tensors",
    "batch/attention_meta": "attention metadata (slots, visibility, rope tables) for the step",
    "model/forward": "model forward outside the layers: expanding the embedding into hc streams",
    "model/layer": "decoder layer outside its parts",
    "embed_head/embedding": "token embedding lookup",
    "embed_head/logits": "compute_logits outside hc_head and norm: the LM head matmul",
    "attention/sliding:proj+kv": "sliding layers' attention outside the sub-parts: q/kv/o projections, "
    "window KV write and gather, concat",
    "attention/csa:proj+kv": "the same for CSA layers",
    "attention/hca:proj+kv": "the same for HCA layers",
    "attention/core": "sink_attention: QK, mask, softmax with the sink, PV",
    "attention/rope": "apply_rope on q, kv and the output (rope inside compressor/indexer counts there)",
    "attention/out_proj": "grouped output projection (wo_a bmm)",
    "attention/compressed_gather": "CSA/HCA: reading compressed rows (and the top-k rows) from the cache",
    "attention/compressor": "CSA/HCA compressor: wkv/wgate projections, state write, pooling of windows",
    "attention/indexer_compressor": "the CSA indexer's compressor (same steps, indexer keys)",
    "attention/indexer": "CSA lightning indexer: query projection, scores over keys, top-k sort",
    "mhc/pre+sinkhorn": "HyperConnection: mixes, pre/post weights and the Sinkhorn iterations",
    "mhc/residual": "hyper_residual: expanding the block output into the streams + comb mix",
    "mhc/head": "HyperHead: the final collapse of the streams",
    "moe/router": "router scores and expert choice (hash table or top-k)",
    "moe/routed_experts": "routed experts: sort by expert, per-expert matmuls, index_add",
    "moe/shared_expert": "shared expert MLP",
    "moe/combine": "MoE forward outside the above: routed + shared",
    "norm/rmsnorm": "weighted RMSNorm (attn/ffn/q/kv/compressor/final norms)",
    "norm/unweighted": "unweighted RMS norm (q heads, hyper-connection inputs)",
    "sampler/sampler": "Sampler: penalties, greedy/random choice, results",
    "compiled/step": "--compile-decode: the compiled static decode step (forward + logits, one graph; its "
    "extern matmuls and the grouped-experts op are listed among the ops) and the null-block zeroing",
}


# --------------------------------------------------------------------------- scopes


@dataclass(frozen=True)
class Target:
    """A class method or a function to wrap in a ``record_function`` scope named ``SCOPE + part``.

    ``part`` may be a function of the call's positional arguments. A scope is not opened when the
    innermost open part starts with one of ``soft`` (e.g. rope inside the indexer stays indexer).
    """

    name: str  # "Class.method" (a class of the model, runner or sampler) or "function"
    part: str | Callable[[tuple[Any, ...]], str]
    soft: tuple[str, ...] = ()


def _attention_part(args: tuple[Any, ...]) -> str:
    self = args[0]
    kind = str(getattr(self, "layer_type", ""))
    if "sparse" in kind or getattr(self, "indexer", None) is not None:
        return "attention/csa:proj+kv"
    if "heavily" in kind or getattr(self, "compressor", None) is not None:
        return "attention/hca:proj+kv"
    return "attention/sliding:proj+kv"


def _pool_part(args: tuple[Any, ...]) -> str:
    self, comp = args[0], args[1] if len(args) > 1 else None
    indexer = getattr(self, "indexer", None)
    if indexer is not None and comp is getattr(indexer, "compressor", None):
        return "attention/indexer_compressor"
    return "attention/compressor"


_IN_COMPRESSED = ("attention/compressor", "attention/indexer")
TARGETS: tuple[Target, ...] = (
    Target("ModelRunner.execute", "engine/runner"),
    Target("build_forward_batch", "batch/forward_batch"),
    Target("DeepseekV4Model.attention_meta", "batch/attention_meta"),
    Target("build_meta", "batch/attention_meta", soft=("batch/attention_meta",)),
    Target("DeepseekV4Model.forward", "model/forward"),
    Target("DeepseekV4Model.compute_logits", "embed_head/logits"),
    Target("Embedding.forward", "embed_head/embedding"),
    Target("DecoderLayer.forward", "model/layer"),
    Target("Attention.forward", _attention_part),
    Target("Attention._grouped_out", "attention/out_proj"),
    Target("Attention._compressed_keys", "attention/compressed_gather"),
    Target("Attention._pool", _pool_part),
    Target("Compressor.forward", "attention/compressor", soft=_IN_COMPRESSED),
    Target("Compressor.compress", "attention/compressor", soft=_IN_COMPRESSED),
    Target("Indexer.forward", "attention/indexer"),
    Target("Indexer.select", "attention/indexer"),
    Target("sink_attention", "attention/core"),
    Target("apply_rope", "attention/rope", soft=(*_IN_COMPRESSED, "batch/")),
    Target("HyperConnection.forward", "mhc/pre+sinkhorn"),
    Target("hyper_residual", "mhc/residual"),
    Target("HyperHead.forward", "mhc/head"),
    Target("Router.forward", "moe/router"),
    Target("Experts.forward", "moe/routed_experts"),
    Target("SharedExpert.forward", "moe/shared_expert"),
    Target("MoE.forward", "moe/combine"),
    Target("RMSNorm.forward", "norm/rmsnorm"),
    Target("unweighted_rms_norm", "norm/unweighted"),
    Target("Sampler.__call__", "sampler/sampler"),
)

_OPEN: list[str] = []  # parts of the scopes open now (the engine steps on one thread)

# torch's fast record_function (~0.5 us a scope, vs ~10 us for ``record_function``); the same events.
_Scope: Callable[[str], AbstractContextManager[Any]] = (
    getattr(getattr(torch._C, "_profiler", None), "_RecordFunctionFast", None) or record_function
)


def _wrap(fn: Callable[..., Any], target: Target) -> Callable[..., Any]:
    part, soft = target.part, target.soft

    @functools.wraps(fn)
    def scoped(*args: Any, **kwargs: Any) -> Any:
        name = part(args) if callable(part) else part
        if soft and _OPEN and _OPEN[-1].startswith(soft):
            return fn(*args, **kwargs)
        _OPEN.append(name)
        try:
            with _Scope(SCOPE + name):
                return fn(*args, **kwargs)
        finally:
            _OPEN.pop()

    return scoped


@dataclass
class Patches:
    undo: list[Callable[[], None]] = field(default_factory=list)
    installed: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    def restore(self) -> None:
        for fn in reversed(self.undo):
            fn()
        self.undo.clear()


def _package_modules() -> list[ModuleType]:
    skip = ("hybridserve.train", "hybridserve.bench", "hybridserve.server")
    return [
        m
        for name, m in list(sys.modules.items())
        if isinstance(m, ModuleType) and name.startswith("hybridserve") and not name.startswith(skip)
    ]


def _classes(llm: Any) -> dict[str, list[type]]:
    """Classes that run in a step, by name: the model's module classes, the runner's, the sampler's."""
    engine = llm.engine
    found: list[type] = [type(m) for m in engine.model.modules()]
    for obj in (engine, getattr(engine, "runner", None), getattr(engine, "scheduler", None)):
        if obj is not None:
            found.append(type(obj))
            found += [type(v) for v in vars(obj).values() if type(v).__module__.startswith("hybridserve")]
    by_name: dict[str, list[type]] = defaultdict(list)
    for cls in found:
        for c in cls.__mro__:
            if c is not object and c not in by_name[c.__name__]:
                by_name[c.__name__].append(c)
    return by_name


# With --compile-decode the model runs inside one graph, where no scope can be injected: the host-side
# parts, and the compiled step as one part.
HOST_PARTS = ("engine/", "batch/", "sampler/")
COMPILED_TARGETS = [t for t in TARGETS if isinstance(t.part, str) and t.part.startswith(HOST_PARTS)] + [
    Target("DecodeGraphRunner._forward", "compiled/step")
]


def install(llm: Any, targets: Iterable[Target]) -> Patches:
    patches = Patches()
    classes = _classes(llm)
    modules = _package_modules()
    for target in targets:
        if "." in target.name:
            cls_name, meth = target.name.split(".", 1)
            owners = [c for c in classes.get(cls_name, []) if meth in vars(c)]
            if not owners:
                patches.missing.append(target.name)
                continue
            for cls in owners:
                orig = vars(cls)[meth]
                setattr(cls, meth, _wrap(orig, target))
                patches.undo.append(functools.partial(setattr, cls, meth, orig))
            patches.installed.append(target.name)
            continue
        originals = {
            id(v): v
            for m in modules
            if inspect.isfunction(v := getattr(m, target.name, None))
            and v.__module__.startswith("hybridserve")
        }
        if not originals:
            patches.missing.append(target.name)
            continue
        for orig in originals.values():
            wrapped = _wrap(orig, target)
            for m in modules:
                for attr, value in list(vars(m).items()):
                    if value is orig:
                        setattr(m, attr, wrapped)
                        patches.undo.append(functools.partial(setattr, m, attr, orig))
        patches.installed.append(target.name)
    return patches


# --------------------------------------------------------------------------- driving the engine


class _Done(BaseException):
    """Raised out of the wrapped engine.step() to leave ``generate`` once every phase ran."""


@dataclass
class Phase:
    """``steps`` steps to measure; with ``max_ratio`` only steps whose wall time is at most that many
    times their CPU time count (the OS did not preempt them), up to ``MAX_TRIES`` x ``steps`` in all."""

    name: str
    steps: int
    max_ratio: float | None = None
    times_ms: list[float] = field(default_factory=list)
    cpu_ms: list[float] = field(default_factory=list)  # this thread's CPU time (less sensitive to load)
    start_context: int = 0  # decode steps before this phase

    def clean(self) -> list[bool]:
        return [
            self.max_ratio is None or w <= self.max_ratio * c
            for w, c in zip(self.times_ms, self.cpu_ms, strict=True)
        ]

    def full(self) -> bool:
        return sum(self.clean()) >= self.steps or len(self.times_ms) >= MAX_TRIES * self.steps


MAX_TRIES = 3


class Driver:
    """Wraps ``llm.engine.step``: waits for steady decode of the whole batch, then runs the phases."""

    def __init__(self, llm: Any, batch: int, phases: list[Phase], on_start: Callable[[str], None]) -> None:
        self.engine = llm.engine
        self.orig_step: Callable[[], list[Any]] = llm.engine.step
        self.batch = batch
        self.phases = phases
        self.on_start = on_start
        self.current = -1  # index into phases; -1 while prefilling
        self.seen: set[str] = set()
        self.prefill_steps = 0
        self.decode_steps = 0
        self.profiled = False

    def step(self) -> list[Any]:
        if self.current >= 0 and self.phases[self.current].name == "profiled":
            with _Scope(SCOPE + STEP_PART):
                t, c = time.perf_counter(), time.thread_time()
                outputs = self.orig_step()
                dt, dc = time.perf_counter() - t, time.thread_time() - c
        else:
            t, c = time.perf_counter(), time.thread_time()
            outputs = self.orig_step()
            dt, dc = time.perf_counter() - t, time.thread_time() - c
        if self.current < 0:
            self.prefill_steps += 1
            self.seen.update(str(o.request_id) for o in outputs)
            if len(self.seen) >= self.batch:
                self._advance()
            return outputs
        if len(outputs) != self.batch or any(getattr(o, "finish_reason", None) for o in outputs):
            raise RuntimeError(
                f"phase {self.phases[self.current].name}: a step returned {len(outputs)} outputs for "
                f"{self.batch} requests (a request finished or failed); raise --max-tokens"
            )
        phase = self.phases[self.current]
        phase.times_ms.append(dt * 1e3)
        phase.cpu_ms.append(dc * 1e3)
        self.decode_steps += 1
        if phase.full():
            self._advance()
        return outputs

    def _advance(self) -> None:
        self.current += 1
        while self.current < len(self.phases) and self.phases[self.current].steps <= 0:
            self.on_start(self.phases[self.current].name)
            self.current += 1
        if self.current >= len(self.phases):
            self.on_start("done")
            raise _Done
        gc.collect()
        self.phases[self.current].start_context = self.decode_steps
        self.on_start(self.phases[self.current].name)


# --------------------------------------------------------------------------- analysis


def _group(part: str) -> str:
    return part.split("/", 1)[0]


@dataclass
class OpStat:
    count: int = 0  # every occurrence, nested ones too
    top_count: int = 0  # called from Python (no aten op around it)
    self_us: float = 0.0
    top_total_us: float = 0.0


def analyse(events: Iterable[Any], keep: list[bool] | None = None) -> dict[str, Any]:
    """Attribute the profiled steps' events (``FunctionEvent``s) to ops and parts.

    ``keep``: per profiled step in order, whether to count it (steps the OS preempted are dropped).
    """
    events = list(events)
    all_steps = sorted(
        (e for e in events if e.name == SCOPE + STEP_PART and _scope_parent(e) is None),
        key=lambda e: e.time_range.start,
    )
    if keep is None or len(keep) != len(all_steps):
        keep = [True] * len(all_steps)
    steps = [e for e, k in zip(all_steps, keep, strict=True) if k]
    n = len(steps)
    if n == 0:
        raise RuntimeError("no profiled steps found in the trace")
    excl: dict[str, float] = defaultdict(float)
    incl: dict[str, float] = defaultdict(float)
    group_incl: dict[str, float] = defaultdict(float)
    op_us: dict[str, float] = defaultdict(float)  # time inside top-level ops, per part
    part_ops: dict[str, int] = defaultdict(int)
    part_op_names: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    part_calls: dict[str, int] = defaultdict(int)
    ops: dict[str, OpStat] = defaultdict(OpStat)

    def visit(e: Any, part: str, stack: tuple[str, ...], in_op: bool) -> None:
        for c in e.cpu_children:
            dur = float(c.time_range.elapsed_us())
            if c.name.startswith(SCOPE):
                p = c.name[len(SCOPE) :]
                excl[p] += dur
                excl[part] -= dur
                part_calls[p] += 1
                if p not in stack:
                    incl[p] += dur
                if _group(p) not in {_group(s) for s in stack}:
                    group_incl[_group(p)] += dur
                visit(c, p, (*stack, p), in_op)
                continue
            st = ops[c.name]
            st.count += 1
            st.self_us += float(c.self_cpu_time_total)
            if not in_op:
                st.top_count += 1
                st.top_total_us += dur
                part_ops[part] += 1
                part_op_names[part][c.name] += 1
                op_us[part] += dur
            visit(c, part, stack, True)

    step_us = []
    for s in steps:
        dur = float(s.time_range.elapsed_us())
        step_us.append(dur)
        excl[STEP_PART] += dur
        incl[STEP_PART] += dur
        group_incl[_group(STEP_PART)] += dur
        part_calls[STEP_PART] += 1
        visit(s, STEP_PART, (STEP_PART,), False)

    total = sum(step_us)
    aten = {k: v for k, v in ops.items() if k.startswith("aten::")}
    parts: list[dict[str, Any]] = [
        {
            "part": p,
            "group": _group(p),
            "ms_per_step": excl[p] / n / 1e3,
            "share": excl[p] / total,
            "in_ops_ms_per_step": op_us[p] / n / 1e3,
            "ops_per_step": part_ops[p] / n,
            "calls_per_step": part_calls[p] / n,
            "inclusive_ms_per_step": incl[p] / n / 1e3,
            "top_ops_per_step": {
                k: v / n for k, v in sorted(part_op_names[p].items(), key=lambda kv: -kv[1])[:8]
            },
            "note": PART_NOTES.get(p, ""),
        }
        for p in sorted(excl, key=lambda k: -excl[k])
    ]
    groups: dict[str, dict[str, float]] = {}
    for row in parts:
        acc = groups.setdefault(
            str(row["group"]),
            {"ms_per_step": 0.0, "share": 0.0, "ops_per_step": 0.0, "in_ops_ms_per_step": 0.0},
        )
        for k in ("ms_per_step", "share", "ops_per_step", "in_ops_ms_per_step"):
            acc[k] += float(row[k])
    for name, acc in groups.items():
        acc["inclusive_ms_per_step"] = group_incl[name] / n / 1e3
        acc["inclusive_share"] = group_incl[name] / total

    def op_row(name: str, st: OpStat) -> dict[str, Any]:
        return {
            "op": name,
            "calls_per_step": st.count / n,
            "top_level_calls_per_step": st.top_count / n,
            "self_ms_per_step": st.self_us / n / 1e3,
            "self_share": st.self_us / total,
            "self_us_per_call": st.self_us / max(st.count, 1),
            "top_level_total_ms_per_step": st.top_total_us / n / 1e3,
        }

    all_ops = [op_row(k, v) for k, v in ops.items()]
    return {
        "steps": n,
        "steps_dropped": len(all_steps) - n,
        "profiled_ms_per_step": {
            "median": statistics.median(step_us) / 1e3,
            "mean": total / n / 1e3,
            "min": min(step_us) / 1e3,
        },
        "aten_ops_per_step": {
            "top_level": sum(v.top_count for v in aten.values()) / n,
            "all": sum(v.count for v in aten.values()) / n,
            "distinct": len(aten),
        },
        "time_in_ops_share": sum(op_us.values()) / total,
        "ops_by_self_time": sorted(all_ops, key=lambda r: -r["self_ms_per_step"]),
        "ops_by_count": sorted(all_ops, key=lambda r: (-r["top_level_calls_per_step"], -r["calls_per_step"])),
        "parts": parts,
        "groups": dict(sorted(groups.items(), key=lambda kv: -kv[1]["ms_per_step"])),
    }


def _scope_parent(e: Any) -> Any:
    p = e.cpu_parent
    while p is not None and not p.name.startswith(SCOPE):
        p = p.cpu_parent
    return p


# --------------------------------------------------------------------------- report


def _stats(times: list[float]) -> dict[str, float]:
    if not times:
        return {}
    s = sorted(times)
    return {
        "median": statistics.median(s),
        "mean": statistics.fmean(s),
        "p10": s[len(s) // 10],
        "p90": s[min(len(s) - 1, (len(s) * 9) // 10)],
        "min": s[0],
        "n": len(s),
    }


def _checkout(pkg_file: str) -> dict[str, Any]:
    root = Path(pkg_file).resolve().parent.parent
    info: dict[str, Any] = {"package": str(Path(pkg_file).resolve().parent)}
    try:
        git = ["git", "-C", str(root)]
        info["commit"] = subprocess.run(
            [*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--", "hybridserve"], capture_output=True, text=True, check=True
        ).stdout.splitlines()
        info["uncommitted_package_files"] = len(dirty)
    except (OSError, subprocess.CalledProcessError):
        pass
    return info


def render(r: dict[str, Any], top: int) -> str:
    a = r["profile"]
    w = r["wall_ms_per_step"]
    lines = [
        f"## {r['label']}: {Path(r['model']).name}, batch {r['batch']}, prompt {r['prompt_len']} tokens, "
        f"{a['steps']} profiled decode steps ({a['steps_dropped']} preempted ones dropped)",
        "",
        "| steps | measured (unpreempted) | wall ms/step median (unpreempted) | CPU ms/step median | "
        "CPU p10 / min | tok/s (CPU median) |",
        "|---|---|---|---|---|---|",
    ]
    for key, title in (("plain", "plain"), ("wrapped", "with scopes"), ("profiled", "under profiler")):
        if w.get(key):
            cpu, clean = r["cpu_ms_per_step"][key], r["unpreempted_wall_ms_per_step"].get(key) or {}
            lines.append(
                f"| {title} | {w[key]['n']} ({clean.get('n', 0)}) | {w[key]['median']:.2f} "
                f"({clean.get('median', float('nan')):.2f}) | {cpu['median']:.2f} | "
                f"{cpu['p10']:.2f} / {cpu['min']:.2f} | {r['batch'] / cpu['median'] * 1e3:.1f} |"
            )
    load = ", ".join(f"{x:.1f}" for x in r["load_average"])
    co = r["checkout"]
    commit = co.get("commit", "?")[:10]
    dirty = co.get("uncommitted_package_files", "?")
    lines[1:1] = ["", f"package {co['package']} (commit {commit}, {dirty} uncommitted package files)"]
    lines += [
        "",
        f"load average at the end: {load} ({r['cpus']} CPUs); prefill took {r['prefill_steps']} steps",
    ]
    ops = a["aten_ops_per_step"]
    lines += [
        "",
        f"aten ops per step: {ops['top_level']:.0f} called from Python ({ops['all']:.0f} with nested ones, "
        f"{ops['distinct']} distinct); {a['time_in_ops_share'] * 100:.0f}% of the profiled step is inside "
        "them (dispatch included), the rest is Python between ops and the profiler's own bookkeeping.",
        "",
        f"Top {top} ops by self CPU time (profiled):",
        "",
        "| op | calls/step | from Python | self ms/step | self % | µs/call |",
        "|---|---|---|---|---|---|",
    ]
    for o in a["ops_by_self_time"][:top]:
        lines.append(
            f"| `{o['op']}` | {o['calls_per_step']:.0f} | {o['top_level_calls_per_step']:.0f} | "
            f"{o['self_ms_per_step']:.2f} | {o['self_share'] * 100:.1f} | {o['self_us_per_call']:.1f} |"
        )
    lines += [
        "",
        f"Top {top} ops by calls from Python per step:",
        "",
        "| op | from Python | all calls | self ms/step |",
        "|---|---|---|---|",
    ]
    for o in a["ops_by_count"][:top]:
        lines.append(
            f"| `{o['op']}` | {o['top_level_calls_per_step']:.0f} | {o['calls_per_step']:.0f} | "
            f"{o['self_ms_per_step']:.2f} |"
        )
    lines += [
        "",
        "Groups (exclusive: innermost scope; inclusive: under the group's outermost scopes):",
        "",
        "| group | ms/step | share | ops/step | inclusive ms/step | inclusive share |",
        "|---|---|---|---|---|---|",
    ]
    for g, row in a["groups"].items():
        lines.append(
            f"| {g} | {row['ms_per_step']:.2f} | {row['share'] * 100:.1f}% | {row['ops_per_step']:.0f} | "
            f"{row['inclusive_ms_per_step']:.2f} | {row['inclusive_share'] * 100:.1f}% |"
        )
    lines += [
        "",
        "Parts (exclusive; 'in ops' is the part of it spent inside aten ops):",
        "",
        "| part | ms/step | share | in ops ms | ops/step | calls/step | most called ops (per step) |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in a["parts"]:
        common = ", ".join(
            f"{k.removeprefix('aten::')} {v:.0f}" for k, v in list(p["top_ops_per_step"].items())[:3]
        )
        lines.append(
            f"| {p['part']} | {p['ms_per_step']:.2f} | {p['share'] * 100:.1f}% | "
            f"{p['in_ops_ms_per_step']:.2f} | {p['ops_per_step']:.0f} | {p['calls_per_step']:.0f} | "
            f"{common} |"
        )
    if r["scopes"]["missing"]:
        lines += ["", f"not in this checkout (no scope): {', '.join(r['scopes']['missing'])}"]
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint folder (default: the package's austen-v4)")
    p.add_argument("--batch", type=int, default=1, help="requests decoding together")
    p.add_argument("--prompt-len", type=int, default=128, help="random prompt tokens per request")
    p.add_argument("--warmup", type=int, default=5, help="decode steps before measuring")
    p.add_argument("--timed-steps", type=int, default=50, help="plain steps timed, nothing injected")
    p.add_argument("--wrapped-steps", type=int, default=20, help="steps timed with scopes, no profiler")
    p.add_argument("--steps", type=int, default=30, help="decode steps under the profiler")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument(
        "--max-wall-over-cpu",
        type=float,
        default=1.15,
        help="profiled steps whose wall time exceeds their CPU time by more (preempted) are not counted",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top", type=int, default=15, help="rows of the op tables")
    p.add_argument("--label", default="run", help="name of this run (e.g. before, after)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON result here")
    p.add_argument("--cache-layout", default=None, help="arena or fixed (default: the engine's)")
    p.add_argument(
        "--compile-decode",
        action="store_true",
        help="profile compiled decode steps (every graph the run needs is compiled first, unmeasured)",
    )
    return p.parse_args(argv)


def _compile_first(llm: Any, args: argparse.Namespace, vocab: int, max_tokens: int) -> float:
    """Decode other prompts of the same batch and lengths, so no graph compiles while measuring; seconds."""
    from hybridserve import SamplingParams

    g = torch.Generator().manual_seed(args.seed + 1)
    others = [torch.randint(10, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)]
    t0 = time.perf_counter()
    llm.generate(others, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    import hybridserve
    from hybridserve import LLM, SamplingParams

    pkg_file = str(hybridserve.__file__)
    model = args.model or str(Path(pkg_file).parent / "assets" / "austen-v4")
    vocab = int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(10, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)]
    ratio = args.max_wall_over_cpu
    phases = [
        Phase("warmup", args.warmup),
        Phase("plain", args.timed_steps, ratio),
        Phase("wrapped", args.wrapped_steps, ratio),
        Phase("profiled", args.steps, ratio),
    ]
    # margin: the requests prefilled first decode a few steps earlier
    max_tokens = args.warmup + MAX_TRIES * sum(ph.steps for ph in phases[1:]) + 64

    t0 = time.perf_counter()
    layout = {} if args.cache_layout is None else {"cache_layout": args.cache_layout}
    llm = LLM(model=model, max_num_seqs=max(args.batch, 1), compile_decode=args.compile_decode, **layout)
    load_s = time.perf_counter() - t0
    targets = COMPILED_TARGETS if args.compile_decode else TARGETS
    compile_s = _compile_first(llm, args, vocab, max_tokens) if args.compile_decode else 0.0
    prof = profile(activities=[ProfilerActivity.CPU], record_shapes=False)
    patches = Patches()

    def on_start(name: str) -> None:
        nonlocal patches
        if name == "wrapped":
            patches = install(llm, targets)
        elif name == "profiled":
            if not patches.installed:
                patches = install(llm, targets)
            prof.start()
        elif name == "done":
            prof.stop()
            patches.restore()

    driver = Driver(llm, args.batch, phases, on_start)
    llm.engine.step = driver.step  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    try:
        llm.generate(prompts, params)
    except _Done:
        pass
    else:
        raise RuntimeError("generation ended before every phase ran; raise --max-tokens")
    finally:
        llm.engine.step = driver.orig_step  # type: ignore[method-assign]
    run_s = time.perf_counter() - t0

    prof_phase = phases[-1]
    ratios = [w / max(c, 1e-6) for w, c in zip(prof_phase.times_ms, prof_phase.cpu_ms, strict=True)]
    keep = prof_phase.clean()
    if sum(keep) < max(3, len(keep) // 4):  # a busy machine throughout: keep the least preempted quarter
        cut = sorted(ratios)[max(3, len(keep) // 4) - 1]
        keep = [r <= cut for r in ratios]
    analysis = analyse(prof.events(), keep)  # type: ignore[no-untyped-call]
    measured = phases[1:]
    wall = {ph.name: _stats(ph.times_ms) for ph in measured}
    cpu = {ph.name: _stats(ph.cpu_ms) for ph in measured}
    clean_wall = {
        ph.name: _stats([t for t, k in zip(ph.times_ms, ph.clean(), strict=True) if k]) for ph in measured
    }
    result: dict[str, Any] = {
        "label": args.label,
        "model": model,
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "threads": args.threads,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "checkout": _checkout(pkg_file),
        "command": " ".join([os.path.relpath(sys.argv[0]) if sys.argv else "profile_step.py", *sys.argv[1:]]),
        "pythonpath": os.environ.get("PYTHONPATH", ""),
        "prefill_steps": driver.prefill_steps,
        "load_s": load_s,
        "compile_decode": args.compile_decode,
        "compile_warmup_s": compile_s,
        "run_s": run_s,
        "max_wall_over_cpu": args.max_wall_over_cpu,
        "wall_ms_per_step": wall,
        "cpu_ms_per_step": cpu,
        "unpreempted_wall_ms_per_step": clean_wall,
        "context_at_phase_start": {ph.name: args.prompt_len + ph.start_context for ph in measured},
        "load_average": list(os.getloadavg()),
        "cpus": os.cpu_count(),
        "scopes": {"installed": patches.installed, "missing": patches.missing},
        "profile": analysis,
    }
    print(render(result, args.top))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
