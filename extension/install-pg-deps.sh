#!/usr/bin/env bash
# Install the PostgreSQL pieces dflash needs: PL/Python 3 and pgvector for the server's
# major version, plus PGXS headers. Debian's pgvector binary is used where it exists
# (Debian 13+); otherwise Debian's pgvector source package is built with PGXS.
# Idempotent: does nothing that is already done. Needs root (or sudo).
set -euo pipefail

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
PG_CONFIG=${PG_CONFIG:-pg_config}
if ! command -v "$PG_CONFIG" >/dev/null; then
    echo "install-pg-deps: pg_config not found; install PostgreSQL first (apt-get install postgresql)" >&2
    exit 1
fi
MAJOR=$("$PG_CONFIG" --version | sed -E 's/^PostgreSQL ([0-9]+).*/\1/')
SHAREDIR=$("$PG_CONFIG" --sharedir)
export DEBIAN_FRONTEND=noninteractive

apt_install() {
    local missing=()
    for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
    [ ${#missing[@]} -eq 0 ] && return 0
    $SUDO apt-get update -qq || true
    $SUDO apt-get install -y -qq "${missing[@]}"
}

apt_install "postgresql-plpython3-$MAJOR" "postgresql-server-dev-$MAJOR" make gcc

if [ -f "$SHAREDIR/extension/vector.control" ]; then
    echo "install-pg-deps: pgvector already installed for PostgreSQL $MAJOR"
elif apt-cache show "postgresql-$MAJOR-pgvector" >/dev/null 2>&1; then
    apt_install "postgresql-$MAJOR-pgvector"
else
    # Debian 12 has no pgvector binary: build Debian 13's source package (0.8.0) with PGXS.
    # The trixie deb-src entry is used only to fetch that source.
    SRC_LIST=/etc/apt/sources.list.d/dflash-trixie-src.list
    if [ ! -f "$SRC_LIST" ]; then
        echo "deb-src http://deb.debian.org/debian trixie main" | $SUDO tee "$SRC_LIST" >/dev/null
    fi
    $SUDO apt-get update -qq || true
    apt_install dpkg-dev
    BUILD=$(mktemp -d)
    trap 'rm -rf "$BUILD"' EXIT
    (cd "$BUILD" && apt-get source -qq --download-only pgvector/trixie && dpkg-source -x --no-check ./pgvector_*.dsc src >/dev/null)
    make -s -C "$BUILD/src" PG_CONFIG="$PG_CONFIG" OPTFLAGS="" >/dev/null
    $SUDO make -s -C "$BUILD/src" PG_CONFIG="$PG_CONFIG" install >/dev/null
    echo "install-pg-deps: built pgvector from Debian's source package for PostgreSQL $MAJOR"
fi
