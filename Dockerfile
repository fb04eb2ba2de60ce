# The gce-watchdog poller as a container (Cloud Run jobs/services, Kubernetes): docs/poller.md.
# The image runs `gce-watchdog poll`; give it its arguments, e.g.
#   docker run IMAGE --label gce-watchdog=on --project P --ledger postgresql://poller@db/wd
# Credentials: the runtime's service account (application default credentials on Cloud Run and
# GKE with Workload Identity). The ledger must be PostgreSQL: a container's disk is not durable.
FROM python:3.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY agent ./agent
RUN python -m venv /opt/gce-watchdog \
 && /opt/gce-watchdog/bin/pip install --no-cache-dir --disable-pip-version-check '.[postgres,pubsub]'

FROM python:3.11-slim-bookworm
COPY --from=build /opt/gce-watchdog /opt/gce-watchdog
# An unprivileged user; its state dir holds the cursors (disposable: a new one rereads the
# retained serial output; the ledger, not the cursor, decides).
RUN useradd --system --uid 10001 --home-dir /var/lib/gce-watchdog --create-home poller
USER 10001
ENV PATH=/opt/gce-watchdog/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    XDG_STATE_HOME=/var/lib/gce-watchdog
ENTRYPOINT ["gce-watchdog", "poll", "--json"]
CMD ["--help"]
