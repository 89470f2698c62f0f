"""Command line: ``hybridserve serve | launch | router | generate | plan | quantize | bench``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable

import torch

from hybridserve.config import EngineConfig


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt")
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass")
    parser.add_argument("--top-k", type=int, default=0, help="0: off")
    parser.add_argument("--ignore-eos", action="store_true", help="keep going past EOS")
    parser.add_argument("--num-threads", type=int, default=0, help="torch CPU threads (0: torch's default)")


def cmd_generate(args: argparse.Namespace) -> int:
    from hybridserve.engine.llm import LLM
    from hybridserve.engine.request import SamplingParams

    _set_threads(args.num_threads)
    config = EngineConfig.from_cli(args)
    llm = LLM(**vars(config))
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
    )
    for prompt, out in zip(args.prompts, llm.generate(args.prompts, params), strict=True):
        completion = out.outputs[0]
        print(f"{prompt}{completion.text}")
        print(f"[{len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}]\n")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from hybridserve.plan_command import run_plan

    return run_plan(args)


def cmd_quantize(args: argparse.Namespace) -> int:
    from hybridserve.models.quantize import quantize_checkpoint

    r = quantize_checkpoint(args.model, args.out, args.weights)
    print(f"{args.out}: {r.quantized} weights as {args.weights}, {r.kept} tensors kept")
    print(f"safetensors bytes: {r.bytes_in:,} -> {r.bytes_out:,} ({r.bytes_out / max(r.bytes_in, 1):.2f}x)")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from hybridserve.bench.cli import run_bench

    return run_bench(args)


def cmd_serve(args: argparse.Namespace) -> int:
    from hybridserve.server.launch import serve

    # On CPU, leave a core to the HTTP event loop: measured here, 2 torch threads on 2 cores made
    # batch-1 decode 1.8x slower than 1 (benchmarks/README.md).
    _set_threads(args.num_threads or max(1, (os.cpu_count() or 2) - 1))
    if args.headless:
        from hybridserve.engine.core.headless import run_headless

        logging.basicConfig(
            level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        return run_headless(EngineConfig.from_cli(args))
    return serve(args)


def cmd_router(args: argparse.Namespace) -> int:
    from hybridserve.router.launch import run_router

    return run_router(args)


def cmd_launch(args: argparse.Namespace) -> int:
    from hybridserve.router.topology import run_launch

    return run_launch(args, args.engine_flags)


def _set_threads(n: int) -> None:
    if n > 0:
        torch.set_num_threads(n)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    commands: dict[str, tuple[Callable[[argparse.Namespace], int], str]] = {
        "serve": (cmd_serve, "start the OpenAI-compatible server"),
        "generate": (cmd_generate, "complete prompts offline"),
        "plan": (cmd_plan, "print the cache plan for a model and memory budget"),
    }
    for name, (fn, help_text) in commands.items():
        p = sub.add_parser(name, help=help_text)
        EngineConfig.add_cli_args(p)
        p.set_defaults(fn=fn)
        if name == "generate":
            _sampling_args(p)
            p.add_argument("prompts", nargs="+")
        if name == "plan":
            from hybridserve.router.topology import add_side_args

            p.add_argument("--json", action="store_true", help="print the plan as JSON (exact bytes)")
            add_side_args(p, default=None)
        if name == "serve":
            from hybridserve.server.args import add_server_args

            add_server_args(p)
    launch = sub.add_parser(
        "launch",
        help="start a router, a prefill side and a decode side (other flags go to both sides' serve)",
    )
    from hybridserve.router.topology import add_launch_args

    add_launch_args(launch)
    launch.set_defaults(fn=cmd_launch)
    router = sub.add_parser("router", help="route the OpenAI API to prefill and decode workers")
    from hybridserve.router.launch import add_router_args

    add_router_args(router)
    router.set_defaults(fn=cmd_router)
    quantize = sub.add_parser("quantize", help="write a checkpoint in DeepSeek's FP8 / FP4-experts layout")
    quantize.add_argument("--model", required=True, help="full-precision Hugging Face model folder")
    quantize.add_argument("--out", required=True, help="new folder for the quantized checkpoint")
    quantize.add_argument("--weights", required=True, choices=["fp8", "fp4-experts"])
    quantize.set_defaults(fn=cmd_quantize)
    bench = sub.add_parser("bench", help="benchmark an OpenAI-compatible endpoint")
    from hybridserve.bench.args import add_bench_args

    add_bench_args(bench)
    bench.set_defaults(fn=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "launch":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.engine_flags = extra  # launch: engine and server flags for both sides
    args.argv = (sys.argv[1:] if argv is None else argv)[1:]  # the command's own flags, as given
    try:
        return int(args.fn(args))
    except (ValueError, OSError) as exc:
        print(f"hybridserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
