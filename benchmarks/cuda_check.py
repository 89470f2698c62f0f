"""CUDA check: does hybridserve decode the same tokens on a GPU as on the CPU, with and without graphs?

Parts (each guarded: a failure prints its traceback, is recorded and the next part runs):

a. greedy tokens (8 prompts x 32 new tokens, batched, ``max_num_seqs`` 16), float32: CPU eager vs
   CUDA eager (``enforce_eager``) vs CUDA with decode steps replayed as CUDA graphs (the CUDA default);
   exact token equality expected, max |logit difference| over the common prefix reported. Run on the
   bundled model and on tiny random checkpoints (``--tiny-dir``: folders made by
   ``tests/tiny_models.make_checkpoint``; built into a temporary folder if absent and transformers is
   importable).
b. the same in bfloat16 on CUDA: graphs vs eager (equality expected), each vs CPU float32 (agreement).
f. extras on the bundled model: MTP speculative decoding and an fp8 KV cache, CUDA graphs vs CPU.
e. the repository's CUDA-only tests (``pytest -k cuda``), if pytest is importable.
d. output tokens/s on the bundled model, float32, eager vs CUDA graphs, at concurrency 1, 16, 64
   (128-token random prompts, 64 new tokens; every level warmed up on other prompts of the same shape).
c. ``compile_decode`` (torch.compile, Triton) vs eager on CUDA, float32: token equality and compile
   seconds. It runs in a child process started first (compiling is mostly CPU work, so it overlaps the
   other parts), killed at the global deadline; part d waits for it until ``--throughput-s`` are left.

Every result goes to ``OUT/cuda_check.json`` (rewritten after each part), with PASS / FAIL / SKIP lines
on stdout. Run from the repository root::

    PYTHONUNBUFFERED=1 python3 benchmarks/cuda_check.py --out "$OUT" --budget 380
    python benchmarks/cuda_check.py --device cpu --quick   # dry run: every "cuda" engine on the CPU
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "hybridserve" / "assets" / "austen-v4"
TINY_NAMES = ("mixed", "csa_heavy", "yarn")


class WarningLog(logging.Handler):
    """Keeps every WARNING+ record (a silent fallback to eager logs one) for the part that runs."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = f"{record.name}: {record.getMessage()}"
        if record.exc_info:
            text += "\n" + "".join(traceback.format_exception(*record.exc_info))[-3000:]
        self.records.append(text)

    def take(self) -> list[str]:
        out, self.records = self.records, []
        return out


WARNINGS = WarningLog()


@dataclass
class Check:
    """The global deadline, the results and where they are written."""

    out: Path
    deadline: float
    device: str
    results: dict[str, Any] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def verdict(self, status: str, text: str) -> None:
        line = f"{status} {text}"
        self.lines.append(line)
        print(line, flush=True)

    def save(self) -> None:
        self.results["summary"] = self.lines
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "cuda_check.json").write_text(json.dumps(self.results, indent=1, default=str))

    def part(self, name: str, fn: Callable[[], dict[str, Any]], need_s: float = 20.0) -> None:
        """Run one part: time-guarded, its exception recorded with the traceback, the JSON rewritten."""
        print(f"\n=== {name} ({self.left():.0f} s left) ===", flush=True)
        if self.left() < need_s:
            self.verdict("SKIP", f"{name}: {self.left():.0f} s left (needs {need_s:.0f})")
            self.results[name] = {"skipped": True}
            self.save()
            return
        start = time.monotonic()
        try:
            result = fn()
        except Exception as exc:
            tb = traceback.format_exc()
            print(tb, flush=True)
            self.verdict("FAIL", f"{name}: {type(exc).__name__}: {exc}")
            result = {"error": f"{type(exc).__name__}: {exc}", "traceback": tb}
        result["seconds"] = round(time.monotonic() - start, 2)
        warned = WARNINGS.take()
        if warned:
            result["warnings"] = warned
            print(f"[{name}] {len(warned)} warning(s) logged:", *(w[:400] for w in warned), sep="\n  ")
        self.results[name] = result
        self.save()


# ---- engine runs --------------------------------------------------------------------------------------
class Recorder:
    """Wraps the runner's sampler: keeps each sampled row's logits (CPU, float32) by (request, index)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.rows: dict[tuple[str, int], torch.Tensor] = {}

    def __call__(self, logits: torch.Tensor, requests: list[Any]) -> Any:
        host = logits.detach().float().cpu()
        for row, req in zip(host, requests, strict=True):
            self.rows[(req.request_id, len(req.output_token_ids))] = row
        return self.inner(logits, requests)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@dataclass
class Run:
    tokens: list[list[int]]
    logits: dict[tuple[str, int], torch.Tensor]
    info: dict[str, Any]


def _sync(device: str) -> None:
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.synchronize()


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def core(llm: Any) -> Any:
    """The LLM's single engine core (no data parallelism here)."""
    from hybridserve.engine.core.engine_core import EngineCore

    assert isinstance(llm.engine, EngineCore)
    return llm.engine


def engine_info(llm: Any) -> dict[str, Any]:
    """How the engine ran: graphs captured, compile state, failed steps."""
    from hybridserve.layers.hyper_connection import compile_enabled

    engine = core(llm)
    graphs = engine.runner.decode_graphs
    info: dict[str, Any] = {
        "device": str(engine.device),
        "dtype": str(engine.dtype),
        "steps": engine.stats.steps,
        "failed_steps": engine.stats.failed_steps,
        "mhc_tail_compiled": compile_enabled(),
        "decode_graphs": graphs is not None,
    }
    if graphs is not None:
        info |= {
            "use_graphs": graphs.use_graphs,
            "graph_keys": [list(k) for k in graphs.entries],
            "graphs_captured": sum(e.graph is not None for e in graphs.entries.values()),
            "compiled": graphs.compiled is not None,
            "compile_seconds": round(graphs.compile_seconds, 2),
        }
    return info


def run_engine(
    model: str,
    prompts: list[list[int]],
    max_tokens: int,
    record: bool = True,
    warmup: bool = False,
    **kwargs: Any,
) -> Run:
    """A fresh LLM(model, **kwargs) generates greedily; tokens, recorded logits and how it ran.
    ``warmup``: run the engine's warm-up (compiles, captures) first, timed apart."""
    from hybridserve import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model, **kwargs)
    load_s = time.perf_counter() - start
    warmup_s = None
    if warmup:
        start = time.perf_counter()
        core(llm).warmup()
        _sync(kwargs.get("device", "cpu"))
        warmup_s = time.perf_counter() - start
        print(f"  warm-up of {kwargs}: {warmup_s:.1f} s", flush=True)
    recorder = None
    if record:
        recorder = Recorder(core(llm).runner.sampler)
        core(llm).runner.sampler = recorder
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    _sync(kwargs.get("device", "cpu"))
    gen_s = time.perf_counter() - start
    info = engine_info(llm) | {
        "load_s": round(load_s, 2),
        "generate_s": round(gen_s, 2),
        "warmup_s": warmup_s,
    }
    reasons = [o.outputs[0].finish_reason for o in outs]
    info["finish_reasons"] = sorted(set(map(str, reasons)))
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    short = [i for i, t in enumerate(tokens) if len(t) != max_tokens]
    if short:
        info["short_outputs"] = short
    logits = recorder.rows if recorder is not None else {}
    del llm
    _free()
    return Run(tokens, logits, info)


def compare(a: Run, b: Run) -> dict[str, Any]:
    """Token agreement of two runs over the same prompts, and their logit difference where the inputs
    were still the same (up to and including each sequence's first differing token)."""
    total = same = equal_seqs = 0
    first_diff: list[int | None] = []
    diff, ref_scale, rows = 0.0, 0.0, 0
    for i, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=True)):
        n = max(len(x), len(y))
        total += n
        same += sum(p == q for p, q in zip(x, y, strict=False))
        k = next((j for j, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), None)
        if k is None and len(x) != len(y):
            k = min(len(x), len(y))
        first_diff.append(k)
        equal_seqs += k is None
        upto = n if k is None else k + 1
        for j in range(upto):
            la, lb = a.logits.get((str(i), j)), b.logits.get((str(i), j))
            if la is not None and lb is not None:
                diff = max(diff, float((la - lb).abs().max()))
                rows += 1
                ref_scale = max(ref_scale, float(la.abs().max()))
    return {
        "tokens_equal": same,
        "tokens_total": total,
        "agreement": same / max(total, 1),
        "sequences_equal": equal_seqs,
        "sequences": len(a.tokens),
        "first_divergence": first_diff,
        "max_abs_logit_diff": diff,
        "max_abs_logit": ref_scale,
        "logit_rows_compared": rows,
        "exact": same == total,
    }


def random_prompts(n: int, length: int, vocab: int, seed: int, lo: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(lo, vocab, (length,), generator=g).tolist() for _ in range(n)]


def text_prompts(model: str, n: int) -> list[list[int]]:
    """The first n lines of the bundled model's held-out text as prompts (else random tokens)."""
    from hybridserve.tokenizer import load_tokenizer

    tok = load_tokenizer(model)
    held = Path(model) / "heldout.txt"
    if tok is None or not held.is_file():
        return random_prompts(n, 24, _vocab(model), seed=7)
    lines = [line.strip() for line in held.read_text().splitlines() if len(line.strip()) > 40]
    return [tok.encode(line[: 40 + 17 * i]) for i, line in enumerate(lines[:n])]


def _vocab(model: str) -> int:
    return int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])


def _label(a: str, b: str, cmp: dict[str, Any]) -> str:
    logits = "logits not recorded"
    if cmp["logit_rows_compared"]:
        logits = f"max|dlogit| {cmp['max_abs_logit_diff']:.3g} (|logit| <= {cmp['max_abs_logit']:.3g})"
    return (
        f"{a} vs {b}: tokens {cmp['tokens_equal']}/{cmp['tokens_total']} "
        f"({cmp['sequences_equal']}/{cmp['sequences']} sequences equal), {logits}"
    )


def _runs_ok(check: Check, name: str, runs: dict[str, Run]) -> bool:
    ok = True
    for label, run in runs.items():
        bad = (
            run.info["failed_steps"] or run.info.get("short_outputs") or "error" in run.info["finish_reasons"]
        )
        if bad:
            check.verdict("FAIL", f"{name} {label}: failed steps / short outputs: {run.info}")
            ok = False
    return ok


# ---- parts ------------------------------------------------------------------------------------------
def part_tokens(check: Check, model: str, name: str, n_prompts: int, max_tokens: int) -> dict[str, Any]:
    """Part a: fp32 CPU vs CUDA eager vs CUDA graphs."""
    cuda = check.device
    prompts = text_prompts(model, n_prompts) if Path(model, "heldout.txt").is_file() else None
    prompts = prompts or random_prompts(n_prompts, 12, _vocab(model), seed=11)
    common: dict[str, Any] = {"max_num_seqs": 16, "dtype": "float32"}
    runs = {
        "cpu": run_engine(model, prompts, max_tokens, device="cpu", **common),
        "eager": run_engine(model, prompts, max_tokens, device=cuda, enforce_eager=True, **common),
        "graphs": run_engine(model, prompts, max_tokens, device=cuda, **common),
    }
    result: dict[str, Any] = {
        "runs": {k: r.info for k, r in runs.items()},
        "prompt_lens": list(map(len, prompts)),
    }
    ok = _runs_ok(check, name, runs)
    graphs = runs["graphs"].info
    if cuda.startswith("cuda") and not graphs.get("graphs_captured"):
        check.verdict("FAIL", f"{name}: no CUDA graph was captured on the default CUDA engine ({graphs})")
        ok = False
    for a, b in (("eager", "cpu"), ("graphs", "cpu"), ("graphs", "eager")):
        cmp = compare(runs[a], runs[b])
        result[f"{a}_vs_{b}"] = cmp
        check.verdict("PASS" if cmp["exact"] and ok else "FAIL", f"{name} fp32 {_label(a, b, cmp)}")
    if cuda.startswith("cuda"):
        check.verdict(
            "INFO", f"{name}: graphs captured {graphs.get('graphs_captured')} keys {graphs.get('graph_keys')}"
        )
    result["tokens_cpu"] = runs["cpu"].tokens
    return result


def part_bf16(check: Check, model: str, n_prompts: int, max_tokens: int) -> dict[str, Any]:
    """Part b: bf16 CUDA eager vs CUDA graphs (equal expected), vs CPU fp32 and CPU bf16 (agreement)."""
    cuda = check.device
    prompts = text_prompts(model, n_prompts)
    runs = {
        "cpu_fp32": run_engine(model, prompts, max_tokens, device="cpu", dtype="float32", max_num_seqs=16),
        "cpu_bf16": run_engine(model, prompts, max_tokens, device="cpu", dtype="bfloat16", max_num_seqs=16),
        "eager": run_engine(
            model, prompts, max_tokens, device=cuda, dtype="bfloat16", enforce_eager=True, max_num_seqs=16
        ),
        "graphs": run_engine(model, prompts, max_tokens, device=cuda, dtype="bfloat16", max_num_seqs=16),
    }
    result: dict[str, Any] = {"runs": {k: r.info for k, r in runs.items()}}
    ok = _runs_ok(check, "bf16", runs)
    for a, b, strict in (
        ("graphs", "eager", True),
        ("eager", "cpu_bf16", False),
        ("eager", "cpu_fp32", False),
        ("graphs", "cpu_fp32", False),
    ):
        cmp = compare(runs[a], runs[b])
        result[f"{a}_vs_{b}"] = cmp
        status = ("PASS" if cmp["exact"] else "FAIL") if strict else "INFO"
        check.verdict(status if ok else "FAIL", f"bf16 {_label(a, b, cmp)}")
    return result


def part_extras(check: Check, model: str, n_prompts: int, max_tokens: int) -> dict[str, Any]:
    """Part f: MTP speculative decoding and an fp8 KV cache on CUDA (graphs on) vs the same on the CPU."""
    cuda = check.device
    prompts = text_prompts(model, n_prompts)
    result: dict[str, Any] = {}
    variants: dict[str, dict[str, Any]] = {
        "mtp2": {"speculative_config": {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}},
        "kv_fp8": {"kv_cache_dtype": "fp8"},
    }
    base = run_engine(model, prompts, max_tokens, device=cuda, dtype="float32", max_num_seqs=16)
    for name, extra in variants.items():
        try:
            common: dict[str, Any] = {"dtype": "float32", "max_num_seqs": 16, **extra}
            runs = {
                "cpu": run_engine(model, prompts, max_tokens, device="cpu", **common),
                "cuda": run_engine(model, prompts, max_tokens, device=cuda, **common),
            }
            ok = _runs_ok(check, name, runs)
            cmp = compare(runs["cuda"], runs["cpu"])
            vs_plain = compare(runs["cuda"], base)
            result[name] = {"runs": {k: r.info for k, r in runs.items()}, "cuda_vs_cpu": cmp}
            result[name]["cuda_vs_cuda_plain"] = vs_plain
            check.verdict("PASS" if ok and cmp["exact"] else "FAIL", f"{name} {_label('cuda', 'cpu', cmp)}")
            check.verdict("INFO", f"{name} {_label('cuda', 'cuda-plain', vs_plain)}")
        except Exception as exc:
            tb = traceback.format_exc()
            print(tb, flush=True)
            check.verdict("FAIL", f"{name}: {type(exc).__name__}: {exc}")
            result[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": tb}
    return result


def part_pytest(check: Check, timeout: float, root: Path) -> dict[str, Any]:
    """Part e: the tests that run only where CUDA is available (``root``: the checkout holding them)."""
    files = ["tests/engine/sample/test_sampler_batched.py", "tests/layers/test_quantized_layers.py"]
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-k", "cuda", *files]
    try:
        proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        check.verdict("FAIL", f"pytest -k cuda: timed out after {timeout:.0f} s")
        return {"timeout": timeout}
    tail = (proc.stdout + proc.stderr)[-4000:]
    print(tail, flush=True)
    check.verdict("PASS" if proc.returncode == 0 else "FAIL", f"pytest -k cuda: rc {proc.returncode}")
    return {"rc": proc.returncode, "output_tail": tail, "cmd": cmd}


def part_throughput(
    check: Check, model: str, levels: list[int], prompt_len: int, max_tokens: int, reserve: float
) -> dict[str, Any]:
    """Part d: output tok/s, eager vs CUDA graphs, one engine per mode serving every level; stops while
    ``reserve`` seconds of the budget (part c's) are still left."""
    from hybridserve import LLM, SamplingParams

    cuda, vocab, top = check.device, _vocab(model), max(levels)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    rows: dict[str, dict[str, Any]] = {}
    for mode, extra in (("eager", {"enforce_eager": True}), ("graphs", {})):
        llm = LLM(
            model,
            device=cuda,
            dtype="float32",
            max_num_seqs=top,
            max_num_batched_tokens=max(512, top * prompt_len),
            enable_prefix_caching=False,
            **extra,
        )
        for c in levels:
            if check.left() < reserve + 20:
                check.verdict("SKIP", f"throughput {mode} c={c}: out of time")
                break
            warm = random_prompts(c, prompt_len, vocab, seed=1000 + c)
            llm.generate([{"prompt_token_ids": p} for p in warm], params)  # captures this level's graphs
            prompts = random_prompts(c, prompt_len, vocab, seed=c)
            _sync(cuda)
            start = time.perf_counter()
            steps0 = core(llm).stats.steps
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            _sync(cuda)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            steps = core(llm).stats.steps - steps0
            row = {"tok_s": tokens / seconds, "seconds": seconds, "tokens": tokens, "steps": steps}
            row["ms_per_step"] = 1000 * seconds / max(steps, 1)
            rows.setdefault(str(c), {})[mode] = row
            print(
                f"  {mode:>6} c={c:<3} {row['tok_s']:9.1f} tok/s  {row['ms_per_step']:.2f} ms/step",
                flush=True,
            )
        rows.setdefault("_info", {})[mode] = engine_info(llm)
        del llm
        _free()
    for c in levels:
        r = rows.get(str(c), {})
        if "eager" in r and "graphs" in r:
            ratio = r["graphs"]["tok_s"] / r["eager"]["tok_s"]
            r["graphs_over_eager"] = ratio
            check.verdict(
                "INFO",
                f"throughput c={c}: eager {r['eager']['tok_s']:.0f} tok/s, graphs {r['graphs']['tok_s']:.0f} "
                f"tok/s ({ratio:.2f}x)",
            )
    return {"levels": levels, "prompt_len": prompt_len, "max_tokens": max_tokens, "rows": rows}


def compile_child(args: argparse.Namespace) -> None:
    """Part c, in its own process: compile_decode (graphs on) vs eager on the device; writes JSON."""
    model, cuda = args.model, args.device
    preflight(Check(Path(args.child_json).parent, time.monotonic() + 60, cuda))
    prompts = text_prompts(model, args.prompts)
    common: dict[str, Any] = {"dtype": "float32", "max_num_seqs": 16}
    eager = run_engine(model, prompts, args.max_tokens, device=cuda, enforce_eager=True, **common)
    compiled = run_engine(
        model, prompts, args.max_tokens, warmup=True, device=cuda, compile_decode=True, **common
    )
    warm_s = compiled.info["warmup_s"]
    cmp = compare(compiled, eager)
    out = {"warmup_s": warm_s, "eager": eager.info, "compiled": compiled.info, "compiled_vs_eager": cmp}
    out["tokens_compiled"] = compiled.tokens
    Path(args.child_json).write_text(json.dumps(out, indent=1, default=str))


class CompileChild:
    """Part c runs in a child process started before the other parts: compiling is CPU work that overlaps
    theirs, and the child's own deadline (``kill_at``) bounds it whatever it does."""

    def __init__(self, check: Check, args: argparse.Namespace) -> None:
        self.json = check.out / "compile_child.json"
        self.log = check.out / "compile_child.log"
        self.json.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--child-compile", "--child-json", str(self.json)]
        cmd += ["--model", args.model, "--device", check.device]
        cmd += ["--prompts", str(args.prompts), "--max-tokens", str(args.max_tokens)]
        self.start = time.perf_counter()
        check.out.mkdir(parents=True, exist_ok=True)
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        print(f"compile_decode child started (pid {self.proc.pid}), log {self.log}", flush=True)

    def running(self) -> bool:
        return self.proc.poll() is None

    def wait(self, seconds: float) -> None:
        """Wait up to ``seconds`` for the child to end (it keeps running past that)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=max(0.0, seconds))

    def finish(self, check: Check) -> dict[str, Any]:
        """Part c's verdicts: the child's result, or its timeout (then it is killed)."""
        rc: int | str | None = self.proc.poll()
        if rc is None:
            self.proc.kill()
            self.proc.wait()
            rc = "killed at the deadline"
        wall = time.perf_counter() - self.start
        tail = self.log.read_text()[-3000:] if self.log.is_file() else ""
        print(f"--- compile child log tail (rc {rc}, {wall:.0f} s) ---\n{tail}", flush=True)
        if not self.json.is_file():
            check.verdict("FAIL", f"compile_decode: child gave no result (rc {rc}, {wall:.0f} s)")
            return {"rc": rc, "wall_s": wall, "log_tail": tail}
        out: dict[str, Any] = json.loads(self.json.read_text()) | {"rc": rc, "wall_s": wall}
        cmp, info = out["compiled_vs_eager"], out["compiled"]
        cpu_tokens = check.results.get("a_fp32_austen", {}).get("tokens_cpu")
        if cpu_tokens is not None:
            out["compiled_equals_cpu_fp32"] = cpu_tokens == out["tokens_compiled"]
            check.verdict(
                "INFO", f"compile_decode tokens == CPU fp32 tokens: {out['compiled_equals_cpu_fp32']}"
            )
        compiled_ok = bool(info.get("compiled")) and not info["failed_steps"]
        status = "PASS" if cmp["exact"] and compiled_ok else "FAIL"
        check.verdict(status, f"compile_decode fp32 {_label('compiled', 'eager', cmp)}")
        check.verdict(
            "INFO" if compiled_ok else "FAIL",
            f"compile_decode: still compiled after the run: {info.get('compiled')}, "
            f"warm-up {out['warmup_s']:.1f} s, compile_seconds {info.get('compile_seconds')}, "
            f"graphs captured {info.get('graphs_captured')}",
        )
        return out


# ---- preflight --------------------------------------------------------------------------------------
def _grouped_mm_works(device: str, dtype: torch.dtype) -> str:
    """'ok' or the error of one small ``F.grouped_mm`` (2-D rows x 3-D weights, int32 group ends)."""
    import torch.nn.functional as F

    try:
        x = torch.randn(6, 16, device=device, dtype=dtype)
        w = torch.randn(3, 32, 16, device=device, dtype=dtype)
        offs = torch.tensor([2, 4, 6], device=device, dtype=torch.int32)
        y = F.grouped_mm(x, w.mT, offs=offs)
        ref = torch.cat([x[2 * g : 2 * g + 2] @ w[g].T for g in range(3)])
        err = float((y.float() - ref.float()).abs().max())
        return "ok" if err < 0.1 else f"wrong result (max err {err:.3g})"
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:300]}"


def preflight(check: Check) -> dict[str, Any]:
    """The torch APIs hybridserve relies on, on this torch build. A missing grouped_mm is shimmed (and
    reported as a FAIL) so that the other parts still run: eager MoE then takes its other paths."""
    import inspect

    import torch.nn.functional as F

    out: dict[str, Any] = {
        "F.grouped_mm": hasattr(F, "grouped_mm"),
        "F.scaled_mm": hasattr(F, "scaled_mm"),
        "mark_unbacked": hasattr(torch._dynamo.decorators, "mark_unbacked"),
        "set_stance_skip_guard_eval_unsafe": "skip_guard_eval_unsafe"
        in inspect.signature(torch.compiler.set_stance).parameters,
    }
    if not out["F.grouped_mm"] and hasattr(torch, "_grouped_mm"):
        F.__dict__["grouped_mm"] = torch._grouped_mm
        check.verdict(
            "FAIL", "torch.nn.functional.grouped_mm missing on this torch; shimmed to torch._grouped_mm"
        )
    cases = {"cpu_fp32": ("cpu", torch.float32), "cpu_bf16": ("cpu", torch.bfloat16)}
    if check.device.startswith("cuda"):
        cases |= {"cuda_bf16": (check.device, torch.bfloat16), "cuda_fp32": (check.device, torch.float32)}
    for name, (dev, dtype) in cases.items():
        out[f"grouped_mm_{name}"] = _grouped_mm_works(dev, dtype)
    from hybridserve.layers import moe

    broken = {dev for name, (dev, _) in cases.items() if out[f"grouped_mm_{name}"] != "ok" and "fp32" in name}
    if out.get("grouped_mm_cuda_bf16", "ok") != "ok":
        broken.add(check.device)
    if broken:
        original = moe._grouped_mm_is_async

        def patched(x: torch.Tensor, hidden: int, inter: int) -> bool:
            return x.device.type not in {torch.device(d).type for d in broken} and original(x, hidden, inter)

        moe._grouped_mm_is_async = patched
        check.verdict(
            "FAIL", f"F.grouped_mm fails on {sorted(broken)}: MoE grouped path disabled there ({out})"
        )
    for key in ("mark_unbacked", "set_stance_skip_guard_eval_unsafe"):
        if not out[key]:
            check.verdict("FAIL", f"torch lacks {key}")
    print(json.dumps(out, indent=1), flush=True)
    return out


# ---- main -------------------------------------------------------------------------------------------
def tiny_checkpoints(tiny_dir: Path) -> dict[str, str]:
    """name -> folder; built with transformers into a temporary folder when ``tiny_dir`` has none."""
    found = {n: str(tiny_dir / n) for n in TINY_NAMES if (tiny_dir / n / "config.json").is_file()}
    if found:
        return found
    try:
        sys.path.append(str(ROOT))
        from tests.tiny_models import SPECS, make_checkpoint
    except Exception as exc:
        print(f"no tiny checkpoints ({type(exc).__name__}: {exc})", flush=True)
        return {}
    base = Path(tempfile.mkdtemp(prefix="tiny_ckpts_"))
    built = {}
    for n in TINY_NAMES:
        try:
            built[n] = str(make_checkpoint(SPECS[n], base / n))
        except Exception as exc:
            print(f"tiny checkpoint {n} not built: {type(exc).__name__}: {exc}", flush=True)
    return built


def environment(device: str) -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "device": device,
        "platform": platform.platform(),
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["capability"] = list(torch.cuda.get_device_capability(0))
        env["torch_cuda"] = torch.version.cuda
    for name in ("triton", "transformers", "zmq", "msgspec", "tokenizers", "safetensors"):
        try:
            env[name] = __import__(name).__version__
        except Exception as exc:
            env[name] = f"not importable: {type(exc).__name__}: {exc}"
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        env["git_head"] = head.stdout.strip()
    except Exception:
        pass
    import hybridserve

    env["hybridserve_from"] = str(Path(hybridserve.__file__).parent)
    return env


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--tiny-dir", default=str(ROOT / ".whl" / "tiny"))
    parser.add_argument("--tests-root", default=str(ROOT), help="the checkout whose tests/ part e runs")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks/results/cuda"))
    parser.add_argument("--device", default="cuda", help="the accelerated device; cpu: a dry run")
    parser.add_argument("--budget", type=float, default=380.0, help="seconds for the whole check")
    parser.add_argument(
        "--throughput-s",
        type=float,
        default=75.0,
        help="seconds kept for part d (waits for part c until then)",
    )
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--levels", default="1,16,64", help="throughput concurrency levels")
    parser.add_argument("--parts", default="a,b,tiny,f,e,d,c")
    parser.add_argument("--quick", action="store_true", help="small throughput sizes (dry runs)")
    parser.add_argument("--child-compile", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-json", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("hybridserve").setLevel(logging.INFO)
    logging.getLogger().addHandler(WARNINGS)
    if args.child_compile:
        compile_child(args)
        return

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("CUDA is not available here: use --device cpu for a dry run", flush=True)
        sys.exit(2)
    check = Check(Path(args.out), time.monotonic() + args.budget, args.device)
    check.results["env"] = environment(args.device)
    check.results["args"] = vars(args)
    print(json.dumps(check.results["env"], indent=1), flush=True)
    check.part("preflight", lambda: preflight(check), need_s=0)
    parts = set(args.parts.split(","))
    model = args.model
    n, k = args.prompts, args.max_tokens
    child = CompileChild(check, args) if "c" in parts else None

    if "a" in parts:
        check.part("a_fp32_austen", lambda: part_tokens(check, model, "austen-v4", n, k))
    if "b" in parts:
        check.part("b_bf16_austen", lambda: part_bf16(check, model, n, k))
    if "tiny" in parts:
        for name, folder in tiny_checkpoints(Path(args.tiny_dir)).items():
            check.part(f"a_fp32_tiny_{name}", partial(part_tokens, check, folder, f"tiny-{name}", n, k))
    if "f" in parts:
        check.part("f_extras_austen", lambda: part_extras(check, model, n, k), need_s=40)
    if "e" in parts:
        check.part(
            "e_pytest_cuda",
            lambda: part_pytest(check, min(120.0, check.left() - 20), Path(args.tests_root)),
            need_s=40,
        )
    if "d" in parts:
        levels = [int(x) for x in args.levels.split(",")]
        prompt_len, new = (32, 16) if args.quick else (128, 64)
        if child is not None:  # measure without the compiler's CPU load, if it ends in time
            child.wait(check.left() - args.throughput_s)
            check.results["compile_child_running_during_d"] = child.running()
        check.part("d_throughput", lambda: part_throughput(check, model, levels, prompt_len, new, 0.0))
    if child is not None:
        child.wait(check.left() - 5)
        check.part("c_compile_decode", lambda: child.finish(check), need_s=0)
    print("\n=== summary ===", *check.lines, sep="\n", flush=True)
    check.save()


if __name__ == "__main__":
    main()
