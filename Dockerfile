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
#
# Build arguments (both optional; tests/root/test_container.py uses them to build offline):
#   BASE        the base image (default python:3.11-slim-bookworm; any image with python3 3.11+
#               and its venv module, e.g. a Debian 12 tree imported with `podman import`)
#   FIND_LINKS  a directory in the build (mounted, e.g. `podman build --volume W:/wheels:ro`)
#               holding the locks' wheels: pip then reads only it (--no-index), the hashes still
#               required. Empty: the package index.
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE} AS build
ARG FIND_LINKS=
WORKDIR /src
COPY packaging/requirements-poller.lock packaging/requirements-build.lock ./packaging/
RUN python3 -m venv /opt/gce-watchdog \
 && /opt/gce-watchdog/bin/pip --isolated install --no-cache-dir --disable-pip-version-check \
      ${FIND_LINKS:+--no-index --find-links=$FIND_LINKS} \
      --require-hashes --only-binary=:all: -r packaging/requirements-poller.lock \
 && python3 -m venv /opt/build \
 && /opt/build/bin/pip --isolated install --no-cache-dir --disable-pip-version-check \
      ${FIND_LINKS:+--no-index --find-links=$FIND_LINKS} \
      --require-hashes --only-binary=:all: -r packaging/requirements-build.lock
COPY pyproject.toml README.md ./
COPY agent ./agent
RUN /opt/build/bin/pip --isolated wheel --no-cache-dir --no-build-isolation --no-deps --no-index \
      -w /tmp/whl . \
 && /opt/gce-watchdog/bin/pip --isolated install --no-cache-dir --no-deps --no-index \
      /tmp/whl/gce_watchdog-*.whl

FROM ${BASE}
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
