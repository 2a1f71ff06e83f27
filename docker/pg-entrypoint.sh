#!/bin/sh
# Entry point of the dflash PostgreSQL image (runs as `postgres`).
# First start (empty $PGDATA): initdb, remote logins by password (POSTGRES_PASSWORD) or
# POSTGRES_HOST_AUTH_METHOD, the scripts in /docker-entrypoint-initdb.d run against POSTGRES_DB
# (CREATE EXTENSION dflash), and, with DFLASH_WORKER_PASSWORD, the worker's queue consumer
# may log in as dflash_worker. The set-up server listens on a private socket only, so the
# health check turns healthy only once the real server runs. Then: exec the command.
set -eu

: "${PGDATA:=/var/lib/postgresql/data}"
DB=${POSTGRES_DB:-postgres}

psql_init() {
    psql -X -q -v ON_ERROR_STOP=1 -h "$INIT_SOCKET" -U postgres "$@"
}

if [ "${1:-}" = postgres ] && [ ! -s "$PGDATA/PG_VERSION" ]; then
    AUTH=${POSTGRES_HOST_AUTH_METHOD:-scram-sha-256}
    if [ "$AUTH" != trust ] && [ -z "${POSTGRES_PASSWORD:-}" ]; then
        echo "dflash-pg: set POSTGRES_PASSWORD (or POSTGRES_HOST_AUTH_METHOD=trust, for tests only)" >&2
        exit 1
    fi
    PWFILE=$(mktemp)
    printf '%s\n' "${POSTGRES_PASSWORD:-}" >"$PWFILE"
    initdb -D "$PGDATA" -U postgres -E UTF8 --locale=C.UTF-8 --auth-local=peer --auth-host="$AUTH" \
        ${POSTGRES_PASSWORD:+--pwfile="$PWFILE"} >/dev/null
    rm -f "$PWFILE"
    echo "host all all all $AUTH" >>"$PGDATA/pg_hba.conf"
    echo "listen_addresses = '*'" >>"$PGDATA/postgresql.conf"

    INIT_SOCKET=$(mktemp -d)
    pg_ctl -D "$PGDATA" -o "-c listen_addresses='' -k $INIT_SOCKET" -w -s start
    [ "$DB" = postgres ] || psql_init -d postgres -v db="$DB" <<'EOF'
CREATE DATABASE :"db";
EOF
    for f in /docker-entrypoint-initdb.d/*.sql; do
        [ -e "$f" ] || continue
        echo "dflash-pg: running $f in database $DB"
        psql_init -d "$DB" -f "$f"
    done
    if [ -n "${DFLASH_WORKER_PASSWORD:-}" ]; then
        psql_init -d "$DB" -v pw="$DFLASH_WORKER_PASSWORD" <<'EOF'
ALTER ROLE dflash_worker LOGIN PASSWORD :'pw';
EOF
    fi
    pg_ctl -D "$PGDATA" -m fast -w -s stop
    rmdir "$INIT_SOCKET"
    echo "dflash-pg: cluster initialised in $PGDATA"
fi

exec "$@"
