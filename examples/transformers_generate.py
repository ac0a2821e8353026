"""Greedy generation with a Hugging Face transformers MoE model, its experts run by transformers'
default backend and by this package's kernels (experts_implementation="moe_kernels").

    python examples/transformers_generate.py                      # a small random Qwen3-MoE
    python examples/transformers_generate.py --layers 8 --experts 128 --top-k 8

The model is built from a config with random weights in bf16 on the GPU (no download), so
the tokens mean nothing; both backends must produce the same ones (bf16 near-ties aside).
Prints both outputs and the time per generated token of each backend.
"""
from __future__ import annotations

import argparse
import time

import torch

import moe_kernels.integrations.transformers  # noqa: F401  registers "moe_kernels"


def build_model(args):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                            num_attention_heads=args.heads, num_key_value_heads=max(1, args.heads // 8),
                            head_dim=args.hidden // args.heads, moe_intermediate_size=args.intermediate,
                            intermediate_size=4 * args.hidden, num_experts=args.experts,
                            num_experts_per_tok=args.top_k, decoder_sparse_step=1, mlp_only_layers=[],
                            max_position_embeddings=4096, bos_token_id=None, eos_token_id=None,
                            pad_token_id=None)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = None  # always `--tokens` new tokens
    return model.to("cuda").eval()


def timed_generate(model, ids, new_tokens: int):
    """(new token ids, seconds) of one greedy generate()."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    return out[0, ids.shape[1]:].tolist(), time.perf_counter() - start


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=20, help="tokens to generate (default 20)")
    p.add_argument("--prompt", type=int, default=32, help="prompt length in tokens (default 32)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size (default 2048, Qwen3-30B-A3B's)")
    p.add_argument("--intermediate", type=int, default=768, help="experts' intermediate size (default 768)")
    p.add_argument("--experts", type=int, default=128, help="routed experts (default 128)")
    p.add_argument("--top-k", type=int, default=8, help="experts per token (default 8)")
    p.add_argument("--heads", type=int, default=32, help="attention heads (default 32)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary size (default 32000)")
    p.add_argument("--seed", type=int, default=0, help="seed for the weights and the prompt")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this example needs a CUDA GPU")
    if args.tokens < 2:
        raise SystemExit(f"--tokens: got {args.tokens}, expected at least 2")

    model = build_model(args)
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, args.vocab, (1, args.prompt), generator=g).cuda()
    results = {}
    for backend in ("grouped_mm", "moe_kernels"):  # transformers' default, then the kernels
        model.set_experts_implementation(backend)
        timed_generate(model, ids, args.tokens)  # warm-up: kernel choices, allocator, caches
        _, first = timed_generate(model, ids, 1)
        tokens, total = timed_generate(model, ids, args.tokens)
        per_token = (total - first) / (args.tokens - 1)  # the decode steps, prefill taken out
        results[backend] = tokens
        print(f"{backend:>11}: {per_token * 1e3:7.2f} ms per token  {tokens}")
    same = results["grouped_mm"] == results["moe_kernels"]
    print("same tokens" if same else "the outputs differ (bf16 near-ties can part greedy decoding)")


if __name__ == "__main__":
    main()
