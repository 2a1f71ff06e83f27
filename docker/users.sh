#!/bin/sh
# The accounts both images share, with fixed ids, so the worker's socket on the shared volume
# is reachable from the PostgreSQL container: the worker (uid 10001) creates the socket with
# group dflash-socket (gid 10100), mode 0660; PostgreSQL's backends run as `postgres`, a member
# of that group. The socket directory is the volume /run/dflash: owner dflash, group
# dflash-socket, mode 2770 (both images create it alike, whichever populates the volume).
#
#   users.sh postgres   in the PostgreSQL image, before postgresql is installed
#   users.sh worker     in the worker image
set -eu

SOCKET_GID=10100
WORKER_UID=10001
POSTGRES_UID=999

groupadd --gid "$SOCKET_GID" dflash-socket
case "$1" in
postgres)
    # Debian's postgresql-common keeps an existing postgres account; fixed ids make data
    # volumes portable between rebuilds.
    groupadd --system --gid "$POSTGRES_UID" postgres
    useradd --system --uid "$POSTGRES_UID" --gid postgres --groups dflash-socket \
        --home-dir /var/lib/postgresql --shell /bin/bash postgres
    mkdir -p /var/lib/postgresql
    chown postgres:postgres /var/lib/postgresql
    ;;
worker)
    useradd --uid "$WORKER_UID" --gid dflash-socket --create-home --home-dir /home/dflash \
        --shell /usr/sbin/nologin dflash
    ;;
*)
    echo "users.sh: postgres or worker" >&2
    exit 2
    ;;
esac
install -d -o "$WORKER_UID" -g "$SOCKET_GID" -m 2770 /run/dflash
