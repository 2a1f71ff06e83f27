#!/bin/sh
# Entry point of the worker image: `dflash serve` on the shared socket volume, the socket
# owned by group dflash-socket (PostgreSQL's backends are members), on the image's device.
# Arguments are passed on, e.g. `--database "host=postgres user=dflash_worker"` for
# generate-on-insert (password in PGPASSWORD). Other commands: --entrypoint dflash.
set -eu
exec dflash serve --socket /run/dflash/worker.sock --socket-group dflash-socket \
    --device "$DFLASH_DEVICE" --dtype "$DFLASH_DTYPE" "$@"
