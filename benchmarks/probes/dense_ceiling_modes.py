"""Why the dense FP8 ceiling (bench.measure_ceilings: torch._scaled_mm, 8192^3) reads about 1300
or about 1455 TFLOP/s from one bench process to the next: which cuBLAS kernel ran, and the SM
clock, power and throttle reasons nvidia-smi saw during each round.

    python3 benchmarks/probes/dense_ceiling_modes.py [--rounds 3] [--seed N]

Prints one line per round (TFLOP/s, median SM clock, median power, the throttle reasons seen)
and the kernel name(s). Run it in several processes in a row to see both modes.
"""
import argparse
import csv
import datetime
import io
import os
import statistics
import subprocess
import sys
import time

import torch

# The bench's own timing, from the source tree (no build needed: profiling is plain Python).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
from moe_kernels.profiling import time_graph  # noqa: E402

FIELDS = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=None)
    args = p.parse_args()
    if args.seed is not None:
        torch.manual_seed(args.seed)
    n = 8192
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    gemm = lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)  # noqa: E731
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        gemm()
        torch.cuda.synchronize()
    kernels = sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})

    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits",
                            "-lms", "50"], stdout=subprocess.PIPE, text=True)
    spans = []
    for _ in range(args.rounds):
        t0 = datetime.datetime.now()
        t = time_graph(gemm, replays=10, per_graph=4)[0]
        spans.append((t0, datetime.datetime.now(), 2 * n ** 3 / t / 1e12))
    time.sleep(0.1)
    smi.terminate()
    rows = list(csv.reader(io.StringIO(smi.communicate()[0])))
    for i, (t0, t1, tflops) in enumerate(spans):
        seen = []
        for r in rows:
            try:
                ts = datetime.datetime.strptime(r[0].strip(), "%Y/%m/%d %H:%M:%S.%f")
            except (ValueError, IndexError):
                continue
            if t0 <= ts <= t1:
                seen.append(r)
        clk = statistics.median(float(r[1]) for r in seen) if seen else float("nan")
        pw = statistics.median(float(r[2]) for r in seen) if seen else float("nan")
        temp = max(float(r[3]) for r in seen) if seen else float("nan")
        reasons = sorted({r[4].strip() for r in seen})
        print(f"round {i}: {tflops:7.1f} TFLOP/s  sm clock {clk:6.0f} MHz  power {pw:5.0f} W  "
              f"temp {temp:.0f} C  samples {len(seen)}  reasons {reasons}")
    print("kernels:", kernels)


if __name__ == "__main__":
    main()
