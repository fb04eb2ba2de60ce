#!/usr/bin/env bash
# Build the wheelhouse the start-up script installs from (gce-watchdog-wheel-url) and the .deb's
# venv is built from: the dependencies pinned by hash in packaging/requirements.lock, a wheel of
# each for every Python the lock is for (CPython 3.11, 3.12, 3.13; downloaded
# once, checked against the lock's hashes, cached by the lock's own hash), the lock itself, and
# the agent's wheel built from this tree. Installing from it needs no index:
#   pip install --no-index --find-links DIR --require-hashes -r DIR/requirements.lock
#   pip install --no-index --no-deps DIR/gce_watchdog-*.whl
#
#   packaging/wheelhouse.sh OUTDIR      -> OUTDIR/wheelhouse/ and OUTDIR/wheelhouse.tar (+ .sha256)
# Env: GCEWD_WHEEL_CACHE (default build/cache/wheels-<lock hash>).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(dirname "$here")"
out="${1:?usage: wheelhouse.sh OUTDIR}"
lock="$here/requirements.lock"
py="$repo/.venv/bin/python"
[ -x "$py" ] || py=python3
t0=$(date +%s)
key="$(sha256sum "$lock" | cut -c1-16)"
cache="${GCEWD_WHEEL_CACHE:-$repo/build/cache/wheels-$key}"
# The Pythons the lock has wheels for (its `# python:` line, packaging/lock.sh): one wheel of each
# compiled dependency per Python; pip picks the one that fits where it installs.
read -ra pyvers <<<"$(sed -n 's/^# python: //p' "$lock")"
[ "${#pyvers[@]}" -gt 0 ] || { echo "wheelhouse.sh: $lock has no '# python:' line (packaging/lock.sh)" >&2; exit 1; }
# One filler per cache at a time (make test's package tests and VM scenarios run side by side).
mkdir -p "$(dirname "$cache")"
exec 8>"$cache.lock"
flock 8
if [ ! -s "$cache/.complete" ]; then
  rm -rf "$cache" && mkdir -p "$cache"
  for v in "${pyvers[@]}"; do
    # --require-hashes: a file whose sha256 is not the lock's is refused here already.
    "$py" -m pip download -q --disable-pip-version-check --dest "$cache" --no-deps --require-hashes \
      --only-binary=:all: --implementation cp --python-version "$v" --abi "cp${v//./}" --abi abi3 \
      --abi none --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux_2_28_x86_64 --platform any -r "$lock" >"$cache.log" 2>&1 || {
        cat "$cache.log" >&2; exit 1; }
  done
  cp "$lock" "$cache/.complete"
fi
wh="$out/wheelhouse"
rm -rf "$wh" "$out/wheelhouse.tar" && mkdir -p "$wh"
cp "$cache"/*.whl "$wh/"
cp "$lock" "$wh/requirements.lock"
# The agent itself, from the working tree (through a temp dir: setuptools leaves build/ and
# *.egg-info next to the sources otherwise).
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# pip builds in the tree (setuptools' build/lib): one build of this tree at a time.
mkdir -p "$repo/build"
exec 7>"$repo/build/.agent-wheel.lock"
flock 7
"$py" -m pip wheel -q --no-deps -w "$tmp" "$repo" >"$tmp/log" 2>&1 || { cat "$tmp/log" >&2; exit 1; }
flock -u 7
cp "$tmp"/gce_watchdog-*.whl "$wh/"
# Reproducible tar: sorted names, fixed owner and mtime.
tar -C "$wh" --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 \
  -cf "$out/wheelhouse.tar.tmp" . && mv "$out/wheelhouse.tar.tmp" "$out/wheelhouse.tar"
sha256sum "$out/wheelhouse.tar" | cut -d' ' -f1 >"$out/wheelhouse.tar.sha256"
echo "wheelhouse.sh: $(find "$wh" -name '*.whl' | wc -l) wheels in $(($(date +%s) - t0))s -> $out/wheelhouse.tar sha256 $(cat "$out/wheelhouse.tar.sha256")" >&2
