#!/usr/bin/env bash
# Build what the fake GCE serves to the e2e guest (http://wheels.test/): the wheelhouse
# (packaging/wheelhouse.sh: the agent's wheel from this tree on every run, requirements.lock and
# the wheels it pins by hash, cached by the lock's hash) and the .deb (packaging/build-deb.sh),
# each with its sha256 (the start-up script requires them).
#
#   e2e/build-wheelhouse.sh OUTDIR GUEST_PY_VERSION     e.g. build/e2e/www 3.11
#
# Writes OUTDIR/wheelhouse.tar(+.sha256), OUTDIR/gce-watchdog.deb(+.sha256) and
# OUTDIR/gce-watchdog-poller.deb.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(dirname "$here")"
out="${1:?usage: build-wheelhouse.sh OUTDIR GUEST_PY_VERSION}"
pyver="${2:?usage: build-wheelhouse.sh OUTDIR GUEST_PY_VERSION}"
# The lock pins wheels for CPython 3.11 (Debian 12): a guest with another Python cannot use them.
[ "$pyver" = 3.11 ] || { echo "build-wheelhouse: the guest has Python $pyver; packaging/requirements.lock is for 3.11" >&2; exit 1; }
t0=$(date +%s)
mkdir -p "$out"
GCEWD_WHEEL_CACHE="$(dirname "$out")/cache/wheels-$(sha256sum "$repo/packaging/requirements.lock" | cut -c1-16)" \
  "$repo/packaging/wheelhouse.sh" "$out"
debdir="$(mktemp -d)"
trap 'rm -rf "$debdir"' EXIT
"$repo/packaging/build-deb.sh" "$debdir"
mv "$debdir"/gce-watchdog_*_amd64.deb "$out/gce-watchdog.deb"
# The poller's package (its unit and libraries): the poller-unit scenario installs it beside.
mv "$debdir"/gce-watchdog-poller_*_amd64.deb "$out/gce-watchdog-poller.deb"
sha256sum "$out/gce-watchdog.deb" | cut -d' ' -f1 >"$out/gce-watchdog.deb.sha256"
echo "build-wheelhouse: wheelhouse and .deb in $(($(date +%s) - t0))s -> $out" >&2
