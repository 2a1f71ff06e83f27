#!/bin/bash
# llama.cpp's cost of a forward of T rows (llama-bench pp T, one batch) against one row (tg),
# for the shipped Q4_K_M and a Q4_0 re-quantization of it (every matrix in a type that
# ggml's repacked AVX2 kernels take), in one run; 2 threads; JSON lines out.
set -e
B=$HOME/.cache/pg_dflash/llama.cpp/0.3.36/build-13a323d05396/bin/llama-bench
for m in "$@"; do
  $B -m "$m" -t 2 -p 2,4,8,16 -n 64 -r 5 -o jsonl 2>/dev/null
done
