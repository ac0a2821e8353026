"""The command line, `python -m moe_kernels info | bench | bench-transformers | profile | tune`: tools
around the library (the library never imports this package)."""
from __future__ import annotations

import argparse
import sys

# What bench, bench-transformers, profile and tune say, with exit code 2, where torch sees no CUDA GPU.
NO_GPU = ("No CUDA GPU is visible (torch.cuda.is_available() is False), so there is nothing to {verb}; "
          "`python -m moe_kernels info` shows what this build holds and the GPUs it runs on.")
NEEDS_GPU = {"bench": "time", "bench-transformers": "time", "profile": "profile", "tune": "tune"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m moe_kernels")
    sub = parser.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="what this build holds and which GPUs it supports")
    p_info.add_argument("--json", action="store_true", help="machine-readable output")
    from . import bench, bench_transformers, tune
    bench.add_arguments(sub.add_parser("bench", help="time the fused layer against its floors and peers"))
    bench_transformers.add_arguments(sub.add_parser(
        "bench-transformers", help="time whole transformers models with each experts backend, ours among them"))
    bench.add_profile_arguments(sub.add_parser(
        "profile", help="forwards between cudaProfilerStart/Stop, for ncu or nsys"))
    tune.add_arguments(sub.add_parser("tune", help="tune tactics per token bucket in a child process"))
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "info":
        from . import info
        return info.main(args)
    import torch
    if not torch.cuda.is_available():
        print(NO_GPU.format(verb=NEEDS_GPU[args.command]), file=sys.stderr)
        return 2
    from . import bench, bench_transformers, tune
    if args.command == "bench-transformers":
        return bench_transformers.main(args)
    if args.command == "tune":
        return tune.main(args)
    if args.command == "profile":
        return bench.profile_main(args)
    return bench.main(args)
