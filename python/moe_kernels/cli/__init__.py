"""The command line, `python -m moe_kernels info | bench | profile | tune`: tools around the
library (the library never imports this package)."""
from __future__ import annotations

import argparse


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_kernels")
    sub = parser.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="what this build holds and which GPUs it supports")
    p_info.add_argument("--json", action="store_true", help="machine-readable output")
    from . import bench, tune
    bench.add_arguments(sub.add_parser("bench", help="time the fused layer against its floors and peers"))
    bench.add_profile_arguments(sub.add_parser(
        "profile", help="forwards between cudaProfilerStart/Stop, for ncu or nsys"))
    tune.add_arguments(sub.add_parser("tune", help="tune tactics per token bucket in a child process"))
    args = parser.parse_args(argv)
    if args.command == "info":
        from . import info
        return info.main(args)
    if args.command == "tune":
        return tune.main(args)
    if args.command == "profile":
        return bench.profile_main(args)
    return bench.main(args)

