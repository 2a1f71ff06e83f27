# PostgreSQL with pgvector, PL/Python 3 and the dflash extension.
# Build from the repository root: docker build -f docker/postgres.Dockerfile -t dflash-pg .
FROM pgvector/pgvector:pg17
RUN apt-get update \
 && apt-get install -y --no-install-recommends postgresql-plpython3-17 postgresql-server-dev-17 make \
 && rm -rf /var/lib/apt/lists/*
COPY extension /src/extension
COPY sql /src/sql
COPY plpython /src/plpython
COPY worker/dflash/__init__.py /src/worker/dflash/__init__.py
COPY worker/dflash/serve/__init__.py worker/dflash/serve/protocol.py worker/dflash/serve/client.py /src/worker/dflash/serve/
RUN make -C /src/extension install && apt-get purge -y postgresql-server-dev-17 && apt-get autoremove -y
# The worker's socket directory is shared with the worker container (compose volume).
RUN mkdir -p /run/dflash && chown postgres:postgres /run/dflash
COPY docker/init-dflash.sql /docker-entrypoint-initdb.d/10-dflash.sql
