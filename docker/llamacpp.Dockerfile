# llama.cpp's llama-server serving the default target (SmolLM2-135M-Instruct Q4_1) with the
# shipped drafter as its DFlash draft model: the endpoint of docker/compose.llamacpp.yaml.
# The build context is NOT the repository: it is made from llama.cpp's portable build (from the
# llama-cpp-python sdist with dflash.llamacpp_build.PORTABLE) and the model files by
#   make images-llamacpp
# (python -m dflash.bench.llamacpp image-context DIR, then docker build -f this file DIR).
# The binaries are built for x86-64 with AVX2 (no AVX-512, no AMX), not for the building CPU:
# the image runs on every CPU kind here (docs/cpus.md has what that costs against a native build).
# Where a registry answers, llama.cpp's own image (ghcr.io/ggml-org/llama.cpp:server, a build
# with src/models/dflash.cpp) runs the same command on the same two files.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
# libgomp1: llama.cpp's CPU threads (OpenMP); curl: the health check.
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libgomp1 curl ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10002 --home-dir /nonexistent --shell /usr/sbin/nologin llama
COPY bin /opt/llama.cpp
COPY models /models
ENV LD_LIBRARY_PATH=/opt/llama.cpp \
    LLAMA_THREADS=2
USER llama
EXPOSE 8080
HEALTHCHECK --interval=3s --timeout=5s --start-period=120s --retries=3 \
    CMD ["curl", "-fsS", "-o", "/dev/null", "http://127.0.0.1:8080/health"]
# Greedy-safe DFlash settings as `python -m dflash.bench.llamacpp serve` uses them: every
# draft position drafted (no confidence cut-off), threads for target and drafter alike.
ENTRYPOINT ["sh", "-c", "exec /opt/llama.cpp/llama-server -m /models/target.gguf -md /models/drafter.gguf \
    --spec-type draft-dflash --spec-draft-n-max \"$(cat /models/draft-n-max)\" --spec-draft-n-min 0 \
    --spec-draft-p-min 0 -t \"$LLAMA_THREADS\" -tb \"$LLAMA_THREADS\" --spec-draft-threads \"$LLAMA_THREADS\" \
    --spec-draft-threads-batch \"$LLAMA_THREADS\" -c 4096 -np 1 --no-webui --metrics --host 0.0.0.0 --port 8080 \"$@\"", \
    "llama-server"]

ARG VERSION=dev
ARG REVISION=unknown
LABEL org.opencontainers.image.title="dflash-llamacpp" \
      org.opencontainers.image.description="llama.cpp llama-server with the dflash default target and DFlash drafter" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0"
