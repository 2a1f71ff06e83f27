#!/bin/bash
# Zen 4 runs of session 13, one after the other, alone on the machine.
cd /work/main
R=docs/results/zen4/s13
mkdir -p $R
step() { echo "== $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg): $*" | tee -a $R/steps.log; }
step setup; /usr/bin/time -v .venv/bin/dflash models qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct > $R/setup.log 2>&1; echo "rc=$?" >> $R/setup.log
step backends; .venv/bin/python -m tools.backends --target qwen2.5-coder-1.5b-instruct --backends llamacpp,ort,ort-q4_k_m --repeats 5 --threads 2 --out $R/backends > $R/backends.log 2>&1
step bench; .venv/bin/dflash bench --target qwen2.5-coder-1.5b-instruct --draft-model qwen2.5-coder-0.5b-instruct --threads 2 --suites code,chat,agent --limit 10 --prompts worker/dflash/suites/repetitive.jsonl --max-new-tokens 128 --methods ar,dflash-auto,suffix,draft-model,llamacpp-ar-gguf,llamacpp-spec-gguf --out $R/qwen-bench > $R/bench.log 2>&1
step load; .venv/bin/python -m dflash.bench.load --target qwen2.5-coder-1.5b-instruct --threads 2 --concurrency 1,8 --requests 16 --max-new-tokens 64 --suite chat --against-plain --against-llama-server --out $R/qwen-load > $R/load.log 2>&1
step done
