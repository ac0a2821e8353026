#!/usr/bin/env bash
# The benchmark runs behind README.md's performance table and docs/performance.md, by name: each
# writes benchmarks/results/<gpu>-<name>.json and .md (<gpu> from nvidia-smi, e.g. h200). Run
# on a GPU machine with moe_kernels installed (the full catalog for published figures).
#
#   benchmarks/run.sh                    # every run below, in this order
#   benchmarks/run.sh w4a16_int4 decode  # some of them
#   OUT_DIR=/tmp/results BENCH_ARGS="--replays 10" benchmarks/run.sh fp8
#   benchmarks/run.sh --list             # each run's name and bench arguments
#
# "transformers" runs `python -m moe_kernels bench-transformers` (whole transformers models with
# each experts backend; needs transformers 5) instead of `bench`, without BENCH_ARGS.
#
# Each run is a few minutes at most on an H100 or H200, so that each fits a job with a time
# limit per command.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${OUT_DIR:-benchmarks/results}
ALL="bf16 fp8 fp8_block w4a16_int4 w4a16_mxfp4 w4a16_mxfp4_deepseek w4a8_int4 w4a8_mxfp4"
ALL="$ALL w4a8_mxfp4_deepseek w4a16_int4_v4_pro w4a8_int4_v4_pro decode decode_fp16 decode_fp8 decode_fp8_block"
ALL="$ALL w4a16_int4_decode w4a16_mxfp4_decode w4a8_int4_decode w4a8_mxfp4_decode w4_decode_widths"
ALL="$ALL w4a8_mxfp4_decode32_rows w4a8_int4_decode32_rows host transformers"
WIDE="--tokens 1,16,128,1024,4096,16384"

args_for() {
  case "$1" in
    bf16)            echo "--preset mixtral-8x7b --preset qwen3-30b-a3b --preset deepseek-v3 $WIDE" ;;
    fp8)             echo "--preset qwen3-30b-a3b --preset deepseek-v3 --quant fp8 $WIDE" ;;
    fp8_block)       echo "--preset deepseek-v3 --preset deepseek-v4-pro --quant fp8_block $WIDE" ;;
    w4a16_int4)      echo "--preset qwen3-30b-a3b --preset deepseek-v3 --quant w4a16_int4 $WIDE" ;;
    w4a16_mxfp4)     echo "--preset gpt-oss-120b --preset gpt-oss-20b --quant w4a16_mxfp4 --activation swiglu_oai $WIDE" ;;
    w4a16_mxfp4_deepseek) echo "--preset deepseek-v3 --preset deepseek-v4-pro --quant w4a16_mxfp4 $WIDE" ;;
    w4a8_int4)       echo "--preset qwen3-30b-a3b --preset deepseek-v3 --quant w4a8_int4 $WIDE" ;;
    w4a8_mxfp4)      echo "--preset gpt-oss-120b --quant w4a8_mxfp4 --activation swiglu_oai $WIDE" ;;
    w4a8_mxfp4_deepseek) echo "--preset deepseek-v3 --preset deepseek-v4-pro --quant w4a8_mxfp4 $WIDE" ;;
    w4a16_int4_v4_pro) echo "--preset deepseek-v4-pro --quant w4a16_int4 $WIDE" ;;
    w4a8_int4_v4_pro)  echo "--preset deepseek-v4-pro --quant w4a8_int4 $WIDE" ;;
    # The decode table of the tuned-Triton comparison: 1-1024 tokens, bf16, against the read-only ceiling
    decode)          echo "--preset mixtral-8x7b --preset qwen3-30b-a3b --preset deepseek-v3 --preset gpt-oss-120b \
                           --tokens 1,2,4,8,16,32,64,128,1024" ;;
    decode_fp16)     echo "--preset mixtral-8x7b --preset qwen3-30b-a3b --quant fp16 --tokens 1,2,4,8,16,32,64,128,1024" ;;
    decode_fp8)      echo "--preset mixtral-8x7b --preset qwen3-30b-a3b --quant fp8 --tokens 1,2,4,8,16,32,64,128,1024" ;;
    decode_fp8_block) echo "--preset deepseek-v3 --quant fp8_block --tokens 1,2,4,8,16,32,64,128,1024" ;;
    # The 4-bit modes at decode sizes beside humming-kernels (W4A8 also beside W4A16 on the same
    # weights): the rows of the runs above at 1-128 tokens, with SM90's wgmma decode kernel
    w4a16_int4_decode)  echo "--preset deepseek-v3 --preset qwen3-30b-a3b --quant w4a16_int4 --tokens 1,16,128" ;;
    w4a16_mxfp4_decode) echo "--preset gpt-oss-120b --quant w4a16_mxfp4 --activation swiglu_oai --tokens 1,16,128" ;;
    w4a8_int4_decode)  echo "--preset deepseek-v3 --quant w4a8_int4 --tokens 1,16,128" ;;
    w4a8_mxfp4_decode) echo "--preset gpt-oss-120b --quant w4a8_mxfp4 --activation swiglu_oai --tokens 1,16,128" ;;
    # The 4-bit decode kernel's two block widths and token tiles in each GEMM slot, round-robin
    # (docs/kernels/decode.md: the width rule is the 16-bit one until this is measured)
    w4_decode_widths) echo "--preset qwen3-30b-a3b --preset deepseek-v3 --quant w4a16_int4 --tokens 1,2,4,8,16,64 \
                           --sweep-only _decode --sweep-rounds 3 --no-peers" ;;
    # SM90's 32-token W4A8 decode block against the contiguous kernel at 8-128 rows per expert
    # (these presets: tokens / 32), for the rule's FOUR_BIT_DECODE_ROWS_32 (python/moe_kernels/tactic.py)
    w4a8_mxfp4_decode32_rows) echo "--preset gpt-oss-120b --preset deepseek-v3 --quant w4a8_mxfp4 \
                           --tokens 256,512,1024,2048,4096 --sweep-only 32x64|contig --no-peers" ;;
    w4a8_int4_decode32_rows) echo "--preset deepseek-v3 --quant w4a8_int4 \
                           --tokens 256,512,1024,2048,4096 --sweep-only 32x64|contig --no-peers" ;;
    # Host time per eager call through the registered op (a signature seen before), beside the graph time
    host)            echo "--preset qwen3-30b-a3b --tokens 1,64,1024 --host --no-peers" ;;
    # Qwen3-30B-A3B and gpt-oss-20b shaped models, 2 layers, with grouped_mm, batched_mm and ours
    transformers)    echo "--models qwen3-30b-a3b,gpt-oss-20b --layers 2 --decode-context 512 --prefill-tokens 2048" ;;
    *) echo "unknown run '$1'; expected one of: $ALL" >&2; return 1 ;;
  esac
}

if [ "${1:-}" = "--list" ]; then
  for name in $ALL; do echo "$name: $(args_for "$name" | tr -s ' ')"; done
  exit 0
fi
for name in ${@:-$ALL}; do args_for "$name" > /dev/null; done  # unknown names fail before any run
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 | grep -oiE "[a-z]+[0-9]+" | head -n 1 \
      | tr '[:upper:]' '[:lower:]')
mkdir -p "$OUT_DIR"
for name in ${@:-$ALL}; do
  a=$(args_for "$name")
  out="$OUT_DIR/$GPU-$name"
  cmd="bench $a ${BENCH_ARGS:-}"
  [ "$name" = transformers ] && cmd="bench-transformers $a"
  echo "== $name: $cmd"
  # shellcheck disable=SC2086
  $PY -m moe_kernels $cmd --json "$out.json" --markdown "$out.md"
done
