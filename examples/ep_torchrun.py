"""Expert parallelism across GPUs with torch.distributed and moe_kernels.FusedMoE.

    torchrun --nproc-per-node 2 examples/ep_torchrun.py                 # bf16, both forms
    torchrun --nproc-per-node 4 examples/ep_torchrun.py --quant fp8 --routing skewed --tokens 1,64,4096
    python examples/ep_torchrun.py --simulate 4                         # one GPU, the ranks in turn

Each of N ranks holds E/N experts in a FusedMoE(..., ep_rank=r, ep_size=N) and its own T
tokens with their router choices. Two ways to run the layer:

- all_to_all: the (token, slot) pairs travel to the rank that holds their expert (the counts
  first, then the rows, ids and weights), each rank runs its experts on what it received, and
  the weighted rows travel back to be summed per token. Moves k rows per token; the split
  sizes are read on the host, so this form is not captured in a CUDA graph.
- allgather: every rank gathers all ranks' tokens, runs its experts on all of them (ids of
  the other ranks' experts contribute nothing, which the kernels do for free) and a
  reduce-scatter sums the partial outputs back to each token's rank. Static shapes: the step
  can be captured in a CUDA graph; what serving stacks do at small batch.

Every rank checks its outputs against a one-GPU reference of the whole layer.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist


def all_to_all_forward(x, topk_ids, topk_weights, experts_per_rank: int, run_experts, group=None):
    """out [T, H] for this rank's tokens: pairs sent to their experts' ranks, run there by
    run_experts(rows [R, H], ids [R, 1], weights [R, 1]) -> weighted rows [R, H], sent back."""
    world = dist.get_world_size(group)
    T, k = topk_ids.shape
    ids = topk_ids.reshape(-1).long()
    dest = torch.where(ids >= 0, ids // experts_per_rank, world)  # -1: no expert, dropped
    order = torch.argsort(dest, stable=True)
    send_counts = torch.bincount(dest, minlength=world + 1)[:world]
    order = order[: int(send_counts.sum())]
    token = order // k
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send, recv = send_counts.tolist(), recv_counts.tolist()  # split sizes: a host sync
    R = sum(recv)

    def exchange(t, rows, out_splits, in_splits):
        out = t.new_empty((rows, *t.shape[1:]))
        dist.all_to_all_single(out, t.contiguous(), out_splits, in_splits, group=group)
        return out
    rows = exchange(x[token], R, recv, send)
    recv_ids = exchange(ids[order].to(topk_ids.dtype), R, recv, send)
    recv_w = exchange(topk_weights.reshape(-1)[order], R, recv, send)
    y = run_experts(rows, recv_ids[:, None], recv_w[:, None])
    back = exchange(y, token.numel(), send, recv)
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    return out.index_add_(0, token, back.float()).to(x.dtype)


def allgather_forward(x, topk_ids, topk_weights, run_experts, group=None):
    """out [T, H] for this rank's tokens (every rank the same T): all tokens gathered, this
    rank's experts run on all of them by run_experts(x, ids, weights), partial outputs summed
    back to their ranks. Shapes are static: capturable in a CUDA graph."""
    world = dist.get_world_size(group)

    def gather(t):
        if dist.get_backend(group) == "gloo":
            parts = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(parts, t.contiguous(), group=group)
            return torch.cat(parts)
        out = t.new_empty((world * t.shape[0], *t.shape[1:]))
        dist.all_gather_into_tensor(out, t.contiguous(), group=group)
        return out
    partial = run_experts(gather(x), gather(topk_ids), gather(topk_weights))
    T = x.shape[0]
    if dist.get_backend(group) == "gloo":  # gloo has no reduce-scatter
        dist.all_reduce(partial, group=group)
        return partial[dist.get_rank(group) * T:][:T].clone()
    out = torch.empty_like(x)
    dist.reduce_scatter_tensor(out, partial, group=group)
    return out


def make_layer_inputs(E, k, H, I, T_per_rank, ranks, routing="uniform", seed=0, dtype=torch.bfloat16):
    """The whole layer's weights and every rank's tokens, the same on every rank (seeded)."""
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * H ** -0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) * I ** -0.5).to(dtype)
    T = T_per_rank * ranks
    x = torch.randn(T, H, generator=g).to(dtype)
    if routing == "skewed":  # Zipf-like popularity: some ranks get most of the rows
        p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.2
        ids = torch.multinomial(p[torch.randperm(E, generator=g)].expand(T, E), k, generator=g)
    else:
        ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :k]
    w = torch.rand(T, k, generator=g) + 0.1
    return w13, w2, x, ids.to(torch.int32), (w / w.sum(1, keepdim=True)).float()


def layer_weights(w13, w2, quant):
    """The layer's weights in `quant` (fp8: E4M3 per channel) as load_weights and the reference
    take them, and the relative error a forward may have against that reference."""
    if quant != "fp8":
        return dict(w13=w13, w2=w2), 2e-2
    from moe_kernels.prepare import quantize_weights
    q = quantize_weights(w13, w2, quant="fp8")
    return {n: q[n] for n in ("w13", "w2", "w13_scale", "w2_scale")}, 5e-2


def _run(args, rank, world, device):
    from moe_kernels import FusedMoE, reference
    E, k, H, I = args.experts, args.top_k, args.hidden, args.intermediate
    per = E // world
    layer = FusedMoE(E, H, I, quant=args.quant, ep_rank=rank, ep_size=world, device=device)
    failures = 0
    for T in args.tokens:
        w13, w2, x, ids, w = make_layer_inputs(E, k, H, I, T, world, args.routing, seed=T)
        weights, tol = layer_weights(w13, w2, args.quant)
        layer.load_weights(weights["w13"], weights["w2"], w13_scale=weights.get("w13_scale"),
                           w2_scale=weights.get("w2_scale"))
        mine = slice(rank * T, (rank + 1) * T)
        xs, idss, ws = (t[mine].to(device) for t in (x, ids, w))
        on_device = {n: t.to(device) for n, t in weights.items()}
        ref = reference.fused_moe(x[mine].to(device), on_device.pop("w13"), on_device.pop("w2"), ws, idss,
                                  quant=args.quant, **on_device)

        def run_experts(rows, r_ids, r_w):
            return layer(rows, r_w, r_ids)
        outs = {"all_to_all": all_to_all_forward(xs, idss, ws, per, run_experts),
                "allgather": allgather_forward(xs, idss, ws, run_experts)}
        if args.graph and device.type == "cuda":  # the allgather step captured and replayed
            allgather_forward(xs, idss, ws, run_experts)  # warm: tactics resolved, NCCL set up
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                graph_out = allgather_forward(xs, idss, ws, run_experts)
            g.replay()
            torch.cuda.synchronize()
            outs["allgather (graph)"] = graph_out
        for form, out in outs.items():
            err = ((out.float() - ref).norm() / ref.norm().clamp_min(1e-6)).item()
            ok = err < tol
            failures += not ok
            print(f"rank {rank}/{world} T={T} {args.quant} {args.routing} {form}: relative error {err:.2e}"
                  f"{'' if ok else '  FAILED'}", flush=True)
    return failures


def simulate(args, ranks: int) -> int:
    """One GPU, the ranks in turn: each rank's FusedMoE on all tokens, the partial outputs
    summed (the allgather form without communication), against the reference; with --graph
    the ranks' forwards and the sum also captured in a CUDA graph and replayed."""
    from moe_kernels import FusedMoE, reference
    E, k, H, I = args.experts, args.top_k, args.hidden, args.intermediate
    failures = 0
    for T in args.tokens:
        w13, w2, x, ids, w = (t.cuda() for t in make_layer_inputs(E, k, H, I, T, 1, args.routing, seed=T))
        weights, tol = layer_weights(w13, w2, args.quant)
        layers = []
        for r in range(ranks):
            layer = FusedMoE(E, H, I, quant=args.quant, ep_rank=r, ep_size=ranks, device="cuda")
            layer.load_weights(weights["w13"], weights["w2"], w13_scale=weights.get("w13_scale"),
                               w2_scale=weights.get("w2_scale"))
            layers.append(layer)

        def step():
            total = torch.zeros(T, H, dtype=torch.float32, device="cuda")
            for layer in layers:
                total += layer(x, w, ids).float()
            return total
        ref = reference.fused_moe(x, weights.pop("w13"), weights.pop("w2"), w, ids, quant=args.quant, **weights)
        outs = {"summed": step()}
        if args.graph:
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                graph_out = step()
            g.replay()
            torch.cuda.synchronize()
            outs["summed (graph)"] = graph_out
        for form, total in outs.items():
            err = ((total - ref).norm() / ref.norm()).item()
            ok = err < tol
            failures += not ok
            print(f"simulated {ranks} ranks, T={T} {args.quant} {args.routing} {form}: relative error {err:.2e}"
                  f"{'' if ok else '  FAILED'}", flush=True)
    return failures


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", dest="top_k", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--tokens", type=lambda s: [int(v) for v in s.split(",")], default=[1, 64, 1024],
                   help="tokens per rank, comma-separated")
    p.add_argument("--quant", choices=("bf16", "fp8"), default="bf16")
    p.add_argument("--routing", choices=("uniform", "skewed"), default="uniform")
    p.add_argument("--graph", action="store_true", help="also capture the allgather step in a CUDA graph")
    p.add_argument("--simulate", type=int, metavar="N", help="one GPU, N ranks in turn (no torch.distributed)")
    args = p.parse_args(argv)
    if args.simulate:
        return int(simulate(args, args.simulate) > 0)
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.experts % world:
        raise SystemExit(f"--experts {args.experts} is not a multiple of the {world} ranks")
    failures = _run(args, rank, world, torch.device("cuda", local))
    t = torch.tensor([failures], device="cuda")
    dist.all_reduce(t)
    dist.destroy_process_group()
    if rank == 0:
        print("all ranks match the reference" if t.item() == 0 else f"{t.item()} checks FAILED")
    return int(t.item() > 0)


if __name__ == "__main__":
    raise SystemExit(main())
