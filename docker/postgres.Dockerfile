# PostgreSQL 15 with PL/Python 3, pgvector and the dflash extension, on Debian 12.
# Build from the repository root (`make images` does this, with the labels):
#   docker build -f docker/postgres.Dockerfile -t dflash-pg .
# BASE_IMAGE: Debian 12 from a registry (default), or the local debootstrap image that
# `make images-base` makes where no registry answers (--build-arg BASE_IMAGE=dflash-base:bookworm).
ARG BASE_IMAGE=debian:bookworm-slim

# --- the runtime: Debian's PostgreSQL and PL/Python, no cluster yet ----------------------------
FROM ${BASE_IMAGE} AS runtime
ARG PG_MAJOR=15
COPY docker/users.sh /usr/local/lib/dflash/users.sh
# Debian's packages would create a cluster at install time; the entrypoint makes it on first start.
RUN sh /usr/local/lib/dflash/users.sh postgres \
 && mkdir -p /etc/postgresql-common/createcluster.d \
 && echo 'create_main_cluster = false' >/etc/postgresql-common/createcluster.d/dflash.conf \
 && apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        postgresql-${PG_MAJOR} postgresql-plpython3-${PG_MAJOR} \
 && rm -rf /var/lib/apt/lists/* \
 && install -d -o postgres -g postgres -m 2775 /var/run/postgresql \
 && install -d -o postgres -g postgres -m 0700 /var/lib/postgresql/data

# --- build stage: PGXS, a compiler, pgvector and the extension (none of it reaches the image) --
FROM runtime AS build
ARG PG_MAJOR=15
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        postgresql-server-dev-${PG_MAJOR} make gcc dpkg-dev
# Debian 12 has no pgvector package: build Debian 13's source package (0.8.0), fetched from
# the same Debian archive this image's apt uses.
RUN mirror=$(apt-get indextargets --format '$(REPO_URI)' 'Codename: bookworm' 'Created-By: Packages' | head -n 1) \
 && echo "deb-src $mirror trixie main" >/etc/apt/sources.list.d/trixie-src.list \
 && apt-get update -qq \
 && mkdir /tmp/pgvector && cd /tmp/pgvector \
 && apt-get source -qq --download-only pgvector/trixie \
 && dpkg-source -x --no-check pgvector_*.dsc src >/dev/null \
 && make -s -C src OPTFLAGS="" \
 && make -s -C src install DESTDIR=/out
# The extension: its SQL (assembled from sql/*.sql), the PL/Python bridge and the worker's
# stdlib-only client. Only these files are copied, so other code changes keep this cache.
COPY extension /src/extension
COPY sql /src/sql
COPY plpython /src/plpython
COPY worker/dflash/__init__.py worker/dflash/options.py worker/dflash/error_codes.py /src/worker/dflash/
COPY worker/dflash/serve /src/worker/dflash/serve
RUN make -s -C /src/extension install DESTDIR=/out

# --- the image ------------------------------------------------------------------------------
FROM runtime
ARG PG_MAJOR=15
COPY --from=build /out/ /
COPY docker/pg-entrypoint.sh /usr/local/bin/dflash-pg-entrypoint
COPY docker/init-dflash.sql /docker-entrypoint-initdb.d/10-dflash.sql
ENV PATH=/usr/lib/postgresql/${PG_MAJOR}/bin:$PATH \
    PGDATA=/var/lib/postgresql/data
USER postgres
WORKDIR /var/lib/postgresql
EXPOSE 5432
STOPSIGNAL SIGINT
# Healthy once the real server accepts connections (first-start set-up runs on a private socket).
HEALTHCHECK --interval=2s --timeout=5s --start-period=120s --retries=3 \
    CMD ["pg_isready", "-q", "-h", "/var/run/postgresql", "-U", "postgres"]
ENTRYPOINT ["dflash-pg-entrypoint"]
CMD ["postgres"]

ARG VERSION=dev
ARG REVISION=unknown
LABEL org.opencontainers.image.title="dflash-pg" \
      org.opencontainers.image.description="PostgreSQL 15 with PL/Python, pgvector and the dflash extension" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0"
