# The gce-watchdog poller as a container (Cloud Run jobs/services, Kubernetes): docs/poller.md.
# The image runs `gce-watchdog poll`; give it its arguments, e.g.
#   docker run IMAGE --label gce-watchdog=on --project P --ledger postgresql://poller@db/wd
# Credentials: the runtime's service account (application default credentials on Cloud Run and
# GKE with Workload Identity). The ledger must be PostgreSQL: a container's disk is not durable,
# and GCE_WATCHDOG_SHARED_LEDGER=required makes `poll` refuse (exit 64) any other ledger
# (--ledger or $GCE_WATCHDOG_LEDGER); set it empty for one replica with a durable volume.
# Cloud Run: `poll --once` rounds as a job; the Pub/Sub worker as a service (it serves GET
# /healthz on $PORT) or a worker pool (docs/poller.md, "Cloud Run"). `docker run IMAGE --version`.
#
# Nothing is installed unpinned (docs/packaging.md): the poller's dependencies (the agent's, plus
# matplotlib for report --png, psycopg, google-cloud-pubsub) from packaging/requirements-poller.lock
# and the build backend from packaging/requirements-build.lock, both --require-hashes, binary
# wheels only; the agent's own wheel is built from this tree with no index.
FROM python:3.11-slim-bookworm AS build
WORKDIR /src
COPY packaging/requirements-poller.lock packaging/requirements-build.lock ./packaging/
RUN python -m venv /opt/gce-watchdog \
 && /opt/gce-watchdog/bin/pip --isolated install --no-cache-dir --disable-pip-version-check \
      --require-hashes --only-binary=:all: -r packaging/requirements-poller.lock \
 && python -m venv /opt/build \
 && /opt/build/bin/pip --isolated install --no-cache-dir --disable-pip-version-check \
      --require-hashes --only-binary=:all: -r packaging/requirements-build.lock
COPY pyproject.toml README.md ./
COPY agent ./agent
RUN /opt/build/bin/pip --isolated wheel --no-cache-dir --no-build-isolation --no-deps --no-index \
      -w /tmp/whl . \
 && /opt/gce-watchdog/bin/pip --isolated install --no-cache-dir --no-deps --no-index \
      /tmp/whl/gce_watchdog-*.whl

FROM python:3.11-slim-bookworm
COPY --from=build /opt/gce-watchdog /opt/gce-watchdog
# An unprivileged user; its state dir holds the cursors (disposable: a new one rereads the
# retained serial output; the ledger, not the cursor, decides).
RUN useradd --system --uid 10001 --home-dir /var/lib/gce-watchdog --create-home poller
USER 10001
ENV PATH=/opt/gce-watchdog/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    XDG_STATE_HOME=/var/lib/gce-watchdog \
    GCE_WATCHDOG_SHARED_LEDGER=required
ENTRYPOINT ["gce-watchdog", "poll", "--json"]
CMD ["--help"]
