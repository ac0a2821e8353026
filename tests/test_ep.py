"""examples/ep_torchrun.py: the two expert-parallel forms (all-to-all, all-gather +
reduce-scatter) with torch.distributed. CPU: two gloo ranks, the experts run by the reference;
GPU: the ranks simulated in turn on one GPU, and NCCL ranks where two or more GPUs are visible."""
import importlib.util
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_kernels import reference

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "ep_torchrun.py")


def _example():
    spec = importlib.util.spec_from_file_location("ep_torchrun", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_rank(rank, world, port, routing):
    ep = _example()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        E, k, H, I = 8, 2, 32, 16
        per, lo = E // world, rank * E // world
        for T in (1, 5, 17):
            w13, w2, x, ids, w = ep.make_layer_inputs(E, k, H, I, T, world, routing, seed=T, dtype=torch.float32)
            calls = []

            def run_experts(rows, r_ids, r_w):  # this rank's experts, ids of other ranks' contribute nothing
                calls.append(rows.shape[0])
                return reference.fused_moe(rows, w13[lo:lo + per], w2[lo:lo + per], r_w, r_ids, expert_offset=lo)
            mine = slice(rank * T, (rank + 1) * T)
            ref = reference.fused_moe(x[mine], w13, w2, w[mine], ids[mine])
            a2a = ep.all_to_all_forward(x[mine], ids[mine], w[mine], per, run_experts)
            ag = ep.allgather_forward(x[mine], ids[mine], w[mine], run_experts)
            torch.testing.assert_close(a2a, ref, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(ag, ref, rtol=1e-5, atol=1e-5)
            # all-to-all runs only the pairs routed here; all-gather every rank's tokens
            assert calls[1] == world * T and calls[0] == int(((ids // per) == rank).sum())
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("routing", ["uniform", "skewed"])
def test_expert_parallel_forms_with_two_gloo_ranks(routing):
    mp.spawn(_gloo_rank, args=(2, _free_port(), routing), nprocs=2)


@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["bf16", "fp8"])
def test_expert_parallel_simulated_on_one_gpu(quant):
    """The ranks in turn on one GPU, as test_expert_parallel_with_nccl runs them across GPUs:
    uniform and skewed routing, 1-4096 tokens, the step also replayed from a CUDA graph."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    for routing in ("uniform", "skewed"):
        args = ["--simulate", "4", "--quant", quant, "--tokens", "1,7,300,4096", "--routing", routing, "--graph"]
        assert _example().main(args) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["bf16", "fp8"])
def test_expert_parallel_with_nccl(quant):
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        pytest.skip(f"needs two or more GPUs ({n} visible)")
    ranks = 4 if n >= 4 else 2
    for routing in ("uniform", "skewed"):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", EXAMPLE,
               "--quant", quant, "--routing", routing, "--tokens", "1,64,4096", "--graph"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert "all ranks match the reference" in r.stdout
